//! `outbox-migrations`: stamp the library's migrations into a service's
//! `migrations/` folder, or check that folder holds byte-identical copies.
//!
//! ```text
//! outbox-migrations check services/orders/migrations
//! outbox-migrations stamp services/orders/migrations
//! outbox-migrations list
//! outbox-migrations stamp --partitioned services/orders/migrations
//! ```
//! `--partitioned` works on the partitioned layout's files (issue 28)
//! instead of the ADR's.
//! Exit status: 0 when identical (or stamped), 1 on a mismatch, 2 on misuse.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use outbox::migrate::{
    FILES, FileStatus, MigrationCheckError, PARTITIONED_FILES, check_files, checksum_hex,
    stamp_files,
};

/// Stamps the library's migrations into a service's migrations folder, or
/// checks that the folder holds byte-identical copies (exit 0 when
/// identical or stamped, 1 on a mismatch, 2 on misuse).
#[derive(Debug, Parser)]
#[command(name = "outbox-migrations", version, about, long_about = None)]
struct Cli {
    /// Work on the partitioned layout's files instead of the ADR's.
    #[arg(long, global = true)]
    partitioned: bool,
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Check that DIR holds byte-identical copies of the migrations.
    Check {
        /// The service's migrations folder.
        dir: PathBuf,
    },
    /// Write the migrations into DIR (those already identical are kept).
    Stamp {
        /// The service's migrations folder.
        dir: PathBuf,
    },
    /// List the migrations with their SHA-384 checksums.
    List,
}

fn report(err: &MigrationCheckError) {
    eprintln!("error: {err}");
    if let MigrationCheckError::Mismatch { files, .. } = err {
        for f in files {
            match &f.status {
                FileStatus::Identical => {}
                FileStatus::Missing => eprintln!("  missing  {}", f.name),
                FileStatus::Differs { found_sha384 } => eprintln!(
                    "  differs  {}\n           expected sha384 {}\n           found    sha384 {found_sha384}",
                    f.name, f.expected_sha384
                ),
                FileStatus::Unreadable { error } => eprintln!("  unreadable {}: {error}", f.name),
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let files = if cli.partitioned {
        PARTITIONED_FILES
    } else {
        FILES
    };
    match cli.action {
        Action::List => {
            for (name, body) in files {
                println!("{name}  sha384:{}", checksum_hex(body.as_bytes()));
            }
            ExitCode::SUCCESS
        }
        Action::Check { dir } => match check_files(&dir, files) {
            Ok(files) => {
                for f in files {
                    println!("identical  {}  sha384:{}", f.name, f.expected_sha384);
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                report(&e);
                ExitCode::from(1)
            }
        },
        Action::Stamp { dir } => match stamp_files(&dir, files) {
            Ok(written) => {
                for name in &written {
                    println!("wrote      {name}");
                }
                println!(
                    "{} written, {} already identical",
                    written.len(),
                    files.len() - written.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                report(&e);
                ExitCode::from(1)
            }
        },
    }
}
