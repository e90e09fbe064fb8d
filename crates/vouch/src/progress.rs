//! The progress bar of the offline commands (check, import, export,
//! migrate). A leaf: those commands import it.

use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `total` bytes, labelled `what`.
pub fn progress_bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}
