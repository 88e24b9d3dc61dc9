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

use std::path::Path;
use std::process::ExitCode;

use outbox::migrate::{
    FILES, FileStatus, MigrationCheckError, PARTITIONED_FILES, check_files, checksum_hex,
    stamp_files,
};

fn usage() -> ExitCode {
    eprintln!("usage: outbox-migrations [--partitioned] check DIR | stamp DIR | list");
    ExitCode::from(2)
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
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let files = match args.iter().position(|a| a == "--partitioned") {
        Some(at) => {
            args.remove(at);
            PARTITIONED_FILES
        }
        None => FILES,
    };
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["list"] => {
            for (name, body) in files {
                println!("{name}  sha384:{}", checksum_hex(body.as_bytes()));
            }
            ExitCode::SUCCESS
        }
        ["check", dir] => match check_files(Path::new(dir), files) {
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
        ["stamp", dir] => match stamp_files(Path::new(dir), files) {
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
        _ => usage(),
    }
}
