//! Keys of encrypted volumes on the command line. A key is never a
//! command-line value: it comes from `--key-file FILE` (exactly 32 raw
//! bytes), else the file named by `VOUCH_KEY_FILE`, else a passphrase typed
//! at a prompt when stdin is a terminal (stretched with Argon2id; the
//! volume's salt and costs are in its superblock). `--keyless` checks an
//! encrypted volume without its key (check, verify, scrub, info).

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::OnceLock;

use anyhow::{bail, Context as _, Result};
use clap::{Args, Subcommand};
use vouch_engine::{open_volume, OpenOptions, UserSecret, Volume};
use vouch_format::superblock::KDF_ARGON2ID;
use vouch_format::FeatureFlags;
use zeroize::Zeroizing;

/// Environment variable naming the key file when `--key-file` is absent.
pub const KEY_FILE_ENV: &str = "VOUCH_KEY_FILE";
/// Environment variable naming the new key file of `vouch key change`.
pub const NEW_KEY_FILE_ENV: &str = "VOUCH_NEW_KEY_FILE";

/// The key of an encrypted volume, for the commands that read or write
/// its data (and `create`/`import`/`serve --create` with --encrypt).
#[derive(Args, Clone, Debug, Default)]
pub struct KeyFileArgs {
    /// Key of an encrypted volume: a file of exactly 32 raw bytes (make one
    /// with `head -c 32 /dev/urandom > FILE`). Without it, the file named by
    /// the VOUCH_KEY_FILE environment variable; without that, a passphrase
    /// is asked for on the terminal. A key is never given as a value on the
    /// command line.
    #[arg(long, value_name = "FILE")]
    pub key_file: Option<PathBuf>,
}

/// `--key-file` and `--keyless`: the commands that verify blocks (check,
/// verify, scrub, info) may do it without the key.
#[derive(Args, Clone, Debug, Default)]
pub struct KeyArgs {
    #[command(flatten)]
    pub file: KeyFileArgs,
    /// Check an encrypted volume without its key: only the keyless guard
    /// (CRC-32C of each block's context and ciphertext) is checked,
    /// read-only; nothing is decrypted.
    #[arg(long)]
    pub keyless: bool,
}

static KEY_ARGS: OnceLock<KeyArgs> = OnceLock::new();

/// Remember the command's key options (once, from `main`).
pub fn init(args: KeyArgs) {
    let _ = KEY_ARGS.set(args);
}

fn key_args() -> KeyArgs {
    KEY_ARGS.get().cloned().unwrap_or_default()
}

/// What a command does with a volume's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Reads or writes data (serve, export, copy, compare, key change).
    Data,
    /// Verifies blocks (check, verify, scrub): `--keyless` allowed.
    Verify,
    /// Shows metadata (info): opened keyless when no key is given.
    Info,
}

/// `options` for opening the volume at `path`, with its key when it is
/// encrypted. A missing key, a key file of the wrong size or a key for a
/// plain volume is an error here, before the volume is opened.
pub fn open_options(path: &Path, mut options: OpenOptions, purpose: Use) -> Result<OpenOptions> {
    let args = key_args();
    let superblock = vouch_engine::volume_superblock(path)?;
    if superblock.features.unknown_incompat() != 0 {
        return Ok(options); // the engine refuses it, saying why
    }
    let encrypted = superblock.features.incompat & FeatureFlags::INCOMPAT_ENCRYPTED != 0;
    if !encrypted {
        // Not an error: one command may open plain and encrypted volumes.
        if args.file.key_file.is_some() {
            tracing::info!(
                "{} is not encrypted: it needs no key (--key-file applies to encrypted volumes)",
                path.display()
            );
        }
        return Ok(options);
    }
    if args.keyless {
        if purpose == Use::Data {
            bail!("--keyless only checks blocks (check, verify, scrub, info); this command needs the key");
        }
        options.keyless = true;
        options.read_only = true;
        return Ok(options);
    }
    let from_file = match &args.file.key_file {
        Some(file) => Some(file.clone()),
        None => std::env::var_os(KEY_FILE_ENV).map(PathBuf::from),
    };
    if let Some(file) = from_file {
        options.key = Some(read_key_file(&file)?);
        return Ok(options);
    }
    if purpose == Use::Info {
        options.keyless = true;
        options.read_only = true;
        return Ok(options);
    }
    if superblock.key_wrap.kdf == KDF_ARGON2ID && std::io::stdin().is_terminal() {
        let passphrase = prompt(&format!("Passphrase for {}: ", path.display()))?;
        options.key = Some(UserSecret::passphrase(&passphrase)?);
        return Ok(options);
    }
    let keyless = if purpose == Use::Verify {
        ", or --keyless to check it without the key"
    } else {
        ""
    };
    let passphrase = if superblock.key_wrap.kdf == KDF_ARGON2ID {
        ", or run on a terminal to type its passphrase"
    } else {
        ""
    };
    bail!(
        "{} is encrypted and no key was given: give it with --key-file FILE or {KEY_FILE_ENV}=FILE (a file of 32 raw bytes){passphrase}{keyless}",
        path.display()
    )
}

/// Open the volume at `path` with its key (`open_options`).
pub fn open(path: &Path, options: OpenOptions, purpose: Use) -> Result<vouch_engine::Volume> {
    let options = open_options(path, options, purpose)?;
    open_volume(path, &options).map_err(|error| match error {
        // One line naming the volume: wrong key, or a key of the wrong kind.
        vouch_engine::Error::Key(message) => anyhow::anyhow!("{}: {message}", path.display()),
        other => other.into(),
    })
}

/// A key file: exactly 32 raw bytes.
pub fn read_key_file(file: &Path) -> Result<UserSecret> {
    let bytes = Zeroizing::new(
        std::fs::read(file).with_context(|| format!("cannot read key file {}", file.display()))?,
    );
    UserSecret::key(&bytes).with_context(|| format!("key file {}", file.display()))
}

/// The key of a new encrypted volume (`--encrypt`): `--key-file`, else
/// `VOUCH_KEY_FILE`, else a new passphrase typed twice on the terminal.
pub fn new_secret() -> Result<UserSecret> {
    let args = key_args();
    let from_file = match &args.file.key_file {
        Some(file) => Some(file.clone()),
        None => std::env::var_os(KEY_FILE_ENV).map(PathBuf::from),
    };
    secret_from(from_file, "--key-file FILE or VOUCH_KEY_FILE=FILE")
}

fn secret_from(file: Option<PathBuf>, how: &str) -> Result<UserSecret> {
    if let Some(file) = file {
        return read_key_file(&file);
    }
    if !std::io::stdin().is_terminal() {
        bail!("an encrypted volume needs a key: give {how} (a file of 32 raw bytes, e.g. from `head -c 32 /dev/urandom`), or run on a terminal to choose a passphrase");
    }
    let first = prompt("New passphrase: ")?;
    let second = prompt("Repeat the passphrase: ")?;
    if first != second {
        bail!("the passphrases differ; nothing was changed");
    }
    Ok(UserSecret::passphrase(&first)?)
}

/// Ask for a passphrase on the controlling terminal. Echo is turned off
/// *before* the prompt is shown, so an answer typed (or pasted) the moment
/// the prompt appears is never echoed; the terminal's settings are restored
/// however the read ends.
fn prompt(text: &str) -> Result<Zeroizing<Vec<u8>>> {
    use std::io::{BufRead as _, Write as _};
    use std::os::fd::AsRawFd as _;
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .context("opening the terminal to read the passphrase")?;
    let hidden = EchoOff::new(tty.as_raw_fd()).context("turning off the terminal's echo")?;
    (&tty)
        .write_all(text.as_bytes())
        .context("writing the prompt")?;
    let mut line = Zeroizing::new(Vec::new());
    std::io::BufReader::new(&tty)
        .read_until(b'\n', &mut line)
        .context("reading the passphrase")?;
    drop(hidden);
    // The newline the user typed was not echoed.
    let _ = (&tty).write_all(b"\n");
    while matches!(line.last(), Some(b'\n' | b'\r')) {
        line.pop();
    }
    Ok(line)
}

/// The terminal's echo switched off until dropped.
struct EchoOff {
    fd: std::os::fd::RawFd,
    saved: libc::termios,
}

impl EchoOff {
    fn new(fd: std::os::fd::RawFd) -> std::io::Result<Self> {
        // SAFETY: termios is plain data; tcgetattr fills it or fails.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd is an open terminal for the duration of the call.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut quiet = saved;
        quiet.c_lflag &= !libc::ECHO;
        // SAFETY: as above; TCSANOW keeps any typeahead.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &quiet) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { fd, saved })
    }
}

impl Drop for EchoOff {
    fn drop(&mut self) {
        // SAFETY: restores the settings read in `new` on the same open fd.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}

/// `vouch key ...`
#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Rewrap an encrypted volume's data key under a new key or passphrase
    /// (instant: no data is rewritten; crash-safe: after a crash exactly one
    /// of the two keys opens the volume). The current key comes from
    /// --key-file / VOUCH_KEY_FILE / the terminal; the new one from
    /// --new-key-file, else VOUCH_NEW_KEY_FILE, else a new passphrase typed
    /// twice. The volume must not be served meanwhile, and must have no
    /// snapshots (each keeps the data key wrapped under the current key).
    Change {
        /// The encrypted volume's directory.
        path: PathBuf,
        /// The new key: a file of exactly 32 raw bytes.
        #[arg(long, value_name = "FILE")]
        new_key_file: Option<PathBuf>,
        /// The current key (see `--key-file` of any command).
        #[command(flatten)]
        key: KeyFileArgs,
    },
}

pub fn run(command: KeyCommand) -> Result<ExitCode> {
    match command {
        KeyCommand::Change {
            path, new_key_file, ..
        } => {
            if vouch_mirror::is_mirrored(&path) {
                anyhow::bail!(
                    "{} is a leg of a mirror: changing the key of mirrored volumes is not supported yet",
                    path.display()
                );
            }
            refuse_with_snapshots(&path)?;
            let volume = open(&path, OpenOptions::default(), Use::Data)?;
            let file =
                new_key_file.or_else(|| std::env::var_os(NEW_KEY_FILE_ENV).map(PathBuf::from));
            let secret = secret_from(file, "--new-key-file FILE or VOUCH_NEW_KEY_FILE=FILE")?;
            volume.change_key(&secret)?;
            volume.close()?;
            println!(
                "{}: key changed; only the new key opens it now",
                path.display()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A snapshot keeps the superblock it was taken with, its key wrap
/// included, around the volume's one data key (which never changes): after
/// a key change the old key would still unwrap it from the snapshot and
/// decrypt the volume. So a volume with snapshots keeps its key until they
/// are deleted (a clone is a volume of its own, with its own wrap).
fn refuse_with_snapshots(path: &std::path::Path) -> Result<()> {
    volume_dir(path)?;
    let snapshots = vouch_engine::snapshot::list(&vouch_engine::snapshot::RealFs::default(), path)?;
    if snapshots.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = snapshots
        .iter()
        .map(|entry| match entry {
            Ok(snapshot) => snapshot.record.name.clone(),
            Err(error) => error.to_string(),
        })
        .collect();
    anyhow::bail!(
        "{} has snapshots ({}): each keeps the volume's data key wrapped under the current key, so the current key would still open the data after a change. Delete them first (vouch snapshot delete), or `vouch clone` one and change the clone's key",
        path.display(),
        names.join(", ")
    )
}

/// Refuse a path that is not a volume directory, saying what it is (does
/// not exist, a file, an empty directory...), before anything in it is
/// read: for the commands that start with a file other than the volume's
/// superblock (a mirror record, a scrub record).
pub fn volume_dir(path: &Path) -> Result<()> {
    vouch_engine::FileStorage::open_superblock(path)?;
    Ok(())
}

/// Open a volume read-only, with its key if it is encrypted (`key::open`).
pub fn open_read_only(path: &Path, purpose: Use) -> Result<Volume> {
    let options = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    open(path, options, purpose)
}
