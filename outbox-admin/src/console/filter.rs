//! What the operator asked for: form and query fields, and the filter the
//! lists and the "everything matching" actions apply.

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use outbox::core::ports::{InboxRow, ParkedRow};

/// `application/x-www-form-urlencoded` fields, repeated names kept.
#[derive(Debug, Default)]
pub struct Form(Vec<(String, String)>);

impl Form {
    /// Fields of a body or a query string.
    pub fn parse(bytes: &[u8]) -> Self {
        Self(form_urlencoded::parse(bytes).into_owned().collect())
    }

    /// The first value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first value of `name`, trimmed, if not empty.
    pub fn text(&self, name: &str) -> Option<String> {
        self.get(name)
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    }

    /// Every value of `name`.
    pub fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A list's filter. Every field narrows; all are optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// The subscription (dead-lettered events only).
    pub subscription: Option<String>,
    /// The routing key; a trailing `*` matches any key with that prefix.
    pub routing_key: Option<String>,
    /// Text the last error contains (case-insensitive).
    pub error: Option<String>,
    /// Parked or dead-lettered at or after.
    pub from: Option<OffsetDateTime>,
    /// Parked or dead-lettered before.
    pub to: Option<OffsetDateTime>,
    /// A payload field (`a.b.0`) that must equal `value`.
    pub path: Option<String>,
    /// What the payload field must equal: a JSON string's text, or the
    /// JSON of any other value (`42`, `true`, `null`).
    pub value: Option<String>,
}

/// The form fields a filter is read from and written to.
pub const FIELDS: [&str; 7] = [
    "subscription",
    "routing_key",
    "error",
    "from",
    "to",
    "path",
    "value",
];

impl Filter {
    /// The filter in `form`, or which field is wrong.
    pub fn from_form(form: &Form) -> Result<Self, String> {
        let time = |name: &str| -> Result<Option<OffsetDateTime>, String> {
            form.text(name)
                .map(|v| {
                    OffsetDateTime::parse(&v, &Rfc3339).map_err(|_| {
                        format!("{name} must be an RFC 3339 time, like 2026-12-04T09:30:00Z")
                    })
                })
                .transpose()
        };
        let f = Self {
            subscription: form.text("subscription"),
            routing_key: form.text("routing_key"),
            error: form.text("error"),
            from: time("from")?,
            to: time("to")?,
            path: form.text("path"),
            value: form
                .get("value")
                .map(str::to_owned)
                .filter(|v| !v.is_empty()),
        };
        if f.path.is_some() != f.value.is_some() {
            return Err("a payload filter needs both a field and a value".into());
        }
        Ok(f)
    }

    /// The filter's fields as `(name, value)`, for links and hidden fields.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let time = |t: &Option<OffsetDateTime>| t.and_then(|t| t.format(&Rfc3339).ok());
        let values = [
            self.subscription.clone(),
            self.routing_key.clone(),
            self.error.clone(),
            time(&self.from),
            time(&self.to),
            self.path.clone(),
            self.value.clone(),
        ];
        FIELDS
            .into_iter()
            .zip(values)
            .filter_map(|(k, v)| v.map(|v| (k, v)))
            .collect()
    }

    fn routing_key_matches(&self, key: &str) -> bool {
        match self.routing_key.as_deref() {
            None => true,
            Some(p) => match p.strip_suffix('*') {
                Some(prefix) => key.starts_with(prefix),
                None => key == p,
            },
        }
    }

    fn error_matches(&self, error: Option<&str>) -> bool {
        match &self.error {
            None => true,
            Some(want) => error.is_some_and(|e| e.to_lowercase().contains(&want.to_lowercase())),
        }
    }

    fn time_matches(&self, at: Option<OffsetDateTime>) -> bool {
        let after = self.from.is_none_or(|from| at.is_some_and(|t| t >= from));
        let before = self.to.is_none_or(|to| at.is_some_and(|t| t < to));
        after && before
    }

    /// Whether a parked row matches, but for the payload field, which a
    /// listing leaves to the database ([`payload_field`](Self::payload_field)).
    pub fn parked(&self, row: &ParkedRow) -> bool {
        self.routing_key_matches(&row.routing_key)
            && self.error_matches(row.last_error.as_deref())
            && self.time_matches(Some(row.parked_at))
    }

    /// Whether a dead-lettered inbox row matches, but for the payload
    /// field, which a listing leaves to the database
    /// ([`payload_field`](Self::payload_field)).
    pub fn dead(&self, row: &InboxRow) -> bool {
        self.subscription
            .as_ref()
            .is_none_or(|s| *s == row.subscription)
            && self.routing_key_matches(&row.routing_key)
            && self.error_matches(row.last_error.as_deref())
            && self.time_matches(row.dead_lettered_at)
    }

    /// The payload field as the database matches it, if one is asked for.
    pub fn payload_field(&self) -> Option<outbox::core::ports::PayloadField> {
        match (&self.path, &self.value) {
            (Some(path), Some(value)) => {
                Some(outbox::core::ports::PayloadField::dotted(path, value))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_form_keeps_repeated_fields_and_a_filter_round_trips() {
        let form = Form::parse(
            b"id=a&id=b&routing_key=orders.*&from=2026-12-04T09%3A30%3A00Z&path=a.0&value=7",
        );
        assert_eq!(form.all("id").collect::<Vec<_>>(), ["a", "b"]);
        let f = Filter::from_form(&form).unwrap();
        let back: String = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(f.pairs())
            .finish();
        assert_eq!(Filter::from_form(&Form::parse(back.as_bytes())).unwrap(), f);
        assert!(f.routing_key_matches("orders.placed") && !f.routing_key_matches("billing.x"));
        let bad = Filter::from_form(&Form::parse(b"from=yesterday")).unwrap_err();
        assert!(bad.contains("from must be"), "{bad}");
        assert!(Filter::from_form(&Form::parse(b"path=a")).is_err());
    }
}
