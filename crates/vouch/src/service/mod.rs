//! Running vouch as a system service: where `vouch serve` listens
//! (`listen`: host names, repeated addresses), sockets a service manager
//! passes (`activation`: systemd socket activation), telling it when the
//! server is ready or stopping (`notify`: sd_notify), and `--pid-file`
//! (`pid_file`).

pub mod activation;
pub mod listen;
pub mod notify;
pub mod pid_file;
