//! Running vouch as a system service: where `vouch serve` listens
//! (`listen`: host names, repeated addresses), sockets a service manager
//! passes (`activation`: systemd socket activation), telling it when the
//! server is ready or stopping (`notify`: sd_notify), `--pid-file`
//! (`pid_file`), and the manual pages a package installs (`man`). The unit
//! files are in dist/systemd/, the Debian package script in scripts/deb.sh.

pub mod activation;
pub mod listen;
pub mod man;
pub mod notify;
pub mod pid_file;
