//! `vouch man DIR` (hidden): one manual page per command, generated from
//! the command-line definition itself, so a page cannot drift from
//! `--help`. scripts/deb.sh runs it with the binary it packages.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use clap::CommandFactory as _;

/// Write `vouch.1` and `vouch-COMMAND[-SUBCOMMAND].1` for every command
/// that is not hidden into `dir` (created if missing); returns their paths.
pub fn generate(dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut command = crate::Cli::command().disable_help_subcommand(true);
    command.build();
    let mut written = Vec::new();
    write_pages(command, dir, &mut written)
        .with_context(|| format!("writing manual pages into {}", dir.display()))?;
    Ok(written)
}

fn write_pages(command: clap::Command, dir: &Path, written: &mut Vec<PathBuf>) -> Result<()> {
    for subcommand in command.get_subcommands().filter(|sub| !sub.is_hide_set()) {
        write_pages(subcommand.clone(), dir, written)?;
    }
    let page = clap_mangen::Man::new(command).manual("vouch manual");
    written.push(page.generate_to(dir)?);
    Ok(())
}

/// `vouch man DIR`: prints each page's path.
pub fn run(dir: &Path) -> Result<std::process::ExitCode> {
    for path in generate(dir)? {
        println!("{}", path.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every visible command's page name, from the definition.
    fn expected_pages(command: &clap::Command, prefix: &str, pages: &mut Vec<String>) {
        let name = if prefix.is_empty() {
            command.get_name().to_string()
        } else {
            format!("{prefix}-{}", command.get_name())
        };
        pages.push(format!("{name}.1"));
        for subcommand in command.get_subcommands() {
            if !subcommand.is_hide_set() && subcommand.get_name() != "help" {
                expected_pages(subcommand, &name, pages);
            }
        }
    }

    #[test]
    fn every_command_gets_a_page_and_hidden_ones_none() {
        let dir = tempfile::tempdir().unwrap();
        generate(dir.path()).unwrap();
        let mut expected = Vec::new();
        expected_pages(&crate::Cli::command(), "", &mut expected);
        expected.sort();
        let mut found: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        found.sort();
        assert_eq!(found, expected);
        for page in ["vouch.1", "vouch-serve.1", "vouch-mirror-replace.1"] {
            assert!(
                found.iter().any(|f| f == page),
                "{page} missing from {found:?}"
            );
        }
        assert!(
            !found.iter().any(|f| f == "vouch-man.1"),
            "the hidden command got a page"
        );
        let serve = std::fs::read_to_string(dir.path().join("vouch-serve.1")).unwrap();
        assert!(
            serve.starts_with(".ie") || serve.contains(".TH"),
            "not roff: {serve:.200}"
        );
        assert!(
            serve.contains("pid\\-file"),
            "--pid-file missing from vouch-serve.1"
        );
    }
}
