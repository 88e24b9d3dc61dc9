//! Every error type of the library, in one place so the variants and what they
//! mean for retries can be read side by side.
//!
//! Store and broker errors carry only text that the adapters built from the
//! driver errors; connection URLs (which may hold passwords) never reach them.

use uuid::Uuid;

/// Why [`crate::Publisher`] refused or failed to write an envelope.
///
/// Every validation variant is raised before anything is written, so the
/// caller's transaction is untouched and can still commit its domain rows
/// (or roll back, as the caller decides).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The routing key is empty.
    #[error("routing key is empty")]
    EmptyRoutingKey,
    /// The routing key exceeds the AMQP short-string limit of 255 bytes.
    #[error("routing key is {bytes} bytes long; the limit is 255")]
    RoutingKeyTooLong {
        /// Its length in bytes.
        bytes: usize,
    },
    /// A header name is empty or longer than 255 bytes.
    #[error("header name {name} is empty or longer than 255 bytes")]
    InvalidHeaderName {
        /// The offending name (shortened).
        name: String,
    },
    /// The envelope id is not a UUID v7 (ids must sort by creation time and
    /// are the inbox key downstream).
    #[error("envelope id {id} is a version-{version} UUID; a v7 UUID is required")]
    IdNotV7 {
        /// The id given.
        id: Uuid,
        /// Its UUID version number.
        version: usize,
    },
    /// A string holds a NUL character, which PostgreSQL `jsonb`/`text` refuse.
    #[error("{location} contains a NUL character, which PostgreSQL cannot store")]
    NulCharacter {
        /// Where: `routing_key`, `header NAME`, or a JSON path in the payload.
        location: String,
    },
    /// The encoded envelope exceeds the configured limit.
    #[error("encoded envelope is {bytes} bytes; the limit is {limit}")]
    PayloadTooLarge {
        /// Encoded size.
        bytes: usize,
        /// Configured limit ([`crate::envelope::EnvelopeLimits`]).
        limit: usize,
    },
    /// The envelope's `traceparent` header (with its `tracestate`) is not
    /// valid W3C trace context, so no consumer could continue the trace.
    #[error("invalid trace context header: {reason}")]
    InvalidTraceContext {
        /// What is wrong with it.
        reason: String,
    },
    /// The envelope's ordering key is empty, too long or holds a NUL.
    #[error("invalid ordering key: {reason}")]
    InvalidOrderingKey {
        /// What is wrong with it.
        reason: String,
    },
    /// The envelope could not be encoded as JSON.
    #[error("envelope could not be encoded: {0}")]
    Encode(String),
    /// Two envelopes with the same id: in one `publish_many_tx` call, or one
    /// already in the outbox.
    #[error("an envelope with id {id} is already in the outbox or in this batch")]
    DuplicateId {
        /// The repeated id.
        id: Uuid,
    },
    /// The database refused or failed the INSERT. The caller's transaction
    /// is aborted by PostgreSQL and must be rolled back.
    #[error("outbox write failed: {0}")]
    Database(#[source] sqlx::Error),
}

/// A configuration value broke a rule; raised at boot, naming the variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `var` holds `value`, which breaks `rule`.
    #[error("{var}={value} is invalid: {rule}")]
    Invalid {
        /// The variable (`CANOPY_MQ_*`, or under the service's own prefix:
        /// [`crate::config::Env`]), or the builder setting.
        var: std::borrow::Cow<'static, str>,
        /// The value seen.
        value: String,
        /// The rule it breaks, in words.
        rule: String,
    },
    /// `var` is set to bytes that are not UTF-8: an error rather than the
    /// default, which would apply whatever the operator meant to set. The
    /// value is not shown (it may be a secret); where it goes wrong is.
    #[error("{var} is invalid: must be UTF-8 (byte {at} of {len} is not)")]
    NotUnicode {
        /// The variable.
        var: String,
        /// The offset of the first byte that is not UTF-8, from 1.
        at: usize,
        /// The value's length in bytes.
        len: usize,
    },
}

/// A failure of the database (the outbox or the inbox store). Neither the
/// drainer nor the subscriber ever bumps `attempts` because of one; only
/// [`StoreError::Refused`] blames the data, and the subscriber dead-letters
/// such a delivery at once instead of retrying it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database could not run the statement now: no connection, a broken
    /// one, the server shutting down or out of resources, or a transient
    /// conflict (serialization failure, deadlock). Retry later.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The statement failed for another reason (a timeout, a constraint).
    /// Retry later.
    #[error("store statement failed: {0}")]
    Statement(String),
    /// The database refused the data itself (SQLSTATE class 22, data
    /// exception): a `\u0000` or a lone surrogate in a `jsonb` string, a
    /// number beyond `jsonb`'s range, text that is not UTF-8, a value nested
    /// past the server's stack (SQLSTATE 54001). Retrying cannot
    /// help; the input is to blame.
    #[error("store refused the data: {0}")]
    Refused(String),
    /// The statement did not run: its transaction was aborted already by
    /// an earlier statement's error (SQLSTATE 25P02), which whoever ran
    /// that statement must have swallowed. Only a rollback helps.
    #[error("transaction already aborted: {0}")]
    Aborted(String),
}

impl StoreError {
    /// The one map from a PostgreSQL SQLSTATE to a store error, used by the
    /// production adapter and by the simulation's fake alike: class 22 (data
    /// exception) is [`Refused`](Self::Refused); 25P02 (in a failed
    /// transaction) is [`Aborted`](Self::Aborted); classes 08 (connection), 53
    /// (insufficient resources), 57P01–57P05 (shutdown, cannot connect now,
    /// idle session timeout), 25P03 (idle-in-transaction timeout), 57014 (a
    /// statement cancelled, by `statement_timeout` or
    /// `pg_cancel_backend`), 55P03 (a lock not had within `lock_timeout` or
    /// `NOWAIT`), the transient conflicts 40001 and 40P01, and a server that
    /// cannot write (25006, a read-only transaction: a standby, or a primary
    /// demoted in place; 0A000 when the server says it is in recovery or a
    /// hot standby) are [`Unavailable`](Self::Unavailable); anything else is
    /// a [`Statement`](Self::Statement) failure.
    ///
    /// ```
    /// use outbox::StoreError;
    /// assert!(matches!(StoreError::from_sqlstate("22P05", "unsupported Unicode escape".into()),
    ///                  StoreError::Refused(_)));
    /// assert!(matches!(StoreError::from_sqlstate("40001", "could not serialize".into()),
    ///                  StoreError::Unavailable(_)));
    /// assert!(matches!(StoreError::from_sqlstate("57014", "statement timeout".into()),
    ///                  StoreError::Unavailable(_)));
    /// assert!(matches!(StoreError::from_sqlstate("25006", "cannot execute LISTEN during recovery".into()),
    ///                  StoreError::Unavailable(_)));
    /// assert!(matches!(StoreError::from_sqlstate("23505", "duplicate key".into()),
    ///                  StoreError::Statement(_)));
    /// assert!(matches!(StoreError::from_sqlstate("0A000", "cannot use serializable mode in a hot standby".into()),
    ///                  StoreError::Unavailable(_)));
    /// assert!(matches!(StoreError::from_sqlstate("0A000", "COPY FROM is not supported".into()),
    ///                  StoreError::Statement(_)));
    /// ```
    pub fn from_sqlstate(code: &str, message: String) -> Self {
        let class = code.get(..2).unwrap_or("");
        match (class, code) {
            // Data the server will not store: a data exception, or a
            // value nested past its stack (`jsonb`, 54001).
            ("22", _) | (_, "54001") => Self::Refused(message),
            (_, "25P02") => Self::Aborted(message),
            ("08" | "53", _)
            | (
                _,
                "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "57P04" | "57P05" | "25P03"
                | "57014" | "55P03" | "25006",
            ) => Self::Unavailable(message),
            // What a standby cannot do (temporary or unlogged relations,
            // serializable transactions): the server's role, not the
            // statement.
            (_, "0A000" | "55000") if in_recovery(&message) => Self::Unavailable(message),
            _ => Self::Statement(message),
        }
    }

    /// Whether the failure is the infrastructure's and passes with time.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

/// Whether a server's message says it is a standby (in recovery, or a hot
/// standby): PostgreSQL's texts for what it refuses there.
fn in_recovery(message: &str) -> bool {
    message.contains("during recovery")
        || message.contains("hot standby")
        || message.contains("recovery is in progress")
}

/// A failure of the broker. Always blameless for the rows involved (a
/// per-message nack is not an error: it is [`crate::core::ports::Confirm::Nack`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The connection could not be made or was lost.
    #[error("broker connection failed: {0}")]
    Connection(String),
    /// The channel was closed by the broker or could not be opened.
    #[error("broker channel failed: {0}")]
    Channel(String),
}

/// Why one drainer tick did not complete. Every variant is infrastructure
/// trouble: the batch's claims were released (or will expire) and no row's
/// `attempts` moved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DrainError {
    /// Phase 2 (channel open, confirm-select, publishes and confirms) did not
    /// finish within `CANOPY_MQ_DRAINER_CONFIRM_TIMEOUT_SECS`.
    #[error("publish+confirm of {rows} rows did not finish within {timeout_secs} s")]
    ConfirmTimeout {
        /// Rows in the batch.
        rows: usize,
        /// The deadline that expired.
        timeout_secs: u64,
    },
    /// The broker failed during Phase 2.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The broker nacked publishes (a queue full under `reject-publish`, or
    /// its own internal error): infrastructure trouble, not the rows'. They
    /// were released without touching `attempts` and are published again
    /// after the drainer's backoff.
    #[error("the broker refused {rows} publishes ({reason}); released without blame")]
    Refused {
        /// Rows nacked in the batch.
        rows: usize,
        /// The first nack's reason.
        reason: String,
    },
    /// The store failed during Phase 1 or Phase 3.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The standbys named in `CANOPY_MQ_DURABLE_STANDBYS` had not flushed
    /// the claimed rows' commits within the batch's Phase-2 deadline: the
    /// rows were released unpublished, without blame.
    #[error("{rows} claimed rows released unpublished: {reason}")]
    NotReplicated {
        /// Rows in the batch.
        rows: usize,
        /// Which standby, and where it stood.
        reason: String,
    },
}

impl DrainError {
    /// Whether the broker connection is implicated (and should be replaced).
    pub fn implicates_broker(&self) -> bool {
        matches!(self, Self::ConfirmTimeout { .. } | Self::Broker(_))
    }
}

/// Why a subscription stopped or could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubscribeError {
    /// The settings break a rule.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The broker refused the topology (queue, dead-letter queue, bindings)
    /// or the consumer; for example a queue that already exists with other
    /// arguments (`PRECONDITION_FAILED`).
    #[error("subscription {queue} could not be set up: {source}")]
    Setup {
        /// The queue.
        queue: String,
        /// What the broker said.
        #[source]
        source: BrokerError,
    },
    /// The subscription's task panicked (its handler, most likely): the
    /// subscription stopped consuming.
    #[error("subscription {queue} stopped: its task panicked: {message}")]
    Panicked {
        /// The queue.
        queue: String,
        /// The panic's message.
        message: String,
    },
}

/// What a handler returns when it cannot apply an event. The subscriber
/// rolls back the handler's transaction, records the message in the inbox
/// row's `last_error` and retries the delivery until the attempt budget is
/// spent, then dead-letters it.
///
/// Database trouble is nobody's fault: an error built from a database error
/// that says the database is unavailable (a lost connection, a shutdown, a
/// serialization failure or deadlock; see [`StoreError::from_sqlstate`]), or
/// with [`HandlerError::unavailable`], counts no attempt: the delivery is
/// rolled back and retried in place once the database answers, and is never
/// dead-lettered because of it.
#[derive(Debug)]
pub struct HandlerError {
    message: String,
    unavailable: bool,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl HandlerError {
    /// A failure described by `message`: it counts an attempt.
    pub fn msg(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            unavailable: false,
            source: None,
        }
    }

    /// The infrastructure the handler needs is unavailable: retried in
    /// place, no attempt counted.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            unavailable: true,
            source: None,
        }
    }

    /// An error caused by `source`, its text the message: the adapter that
    /// knows `source`'s kind says whether it is infrastructure trouble.
    pub(crate) fn with_source(
        source: impl std::error::Error + Send + Sync + 'static,
        unavailable: bool,
    ) -> Self {
        Self {
            message: source.to_string(),
            unavailable,
            source: Some(Box::new(source)),
        }
    }

    /// The message recorded in `last_error`.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether this is infrastructure trouble (no attempt counted).
    pub fn is_unavailable(&self) -> bool {
        self.unavailable
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<StoreError> for HandlerError {
    fn from(e: StoreError) -> Self {
        let unavailable = e.is_unavailable();
        Self::with_source(e, unavailable)
    }
}

impl From<serde_json::Error> for HandlerError {
    fn from(e: serde_json::Error) -> Self {
        Self {
            message: format!("payload: {e}"),
            unavailable: false,
            source: Some(Box::new(e)),
        }
    }
}
