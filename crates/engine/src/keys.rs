//! Keys of an encrypted volume. The data key (32 random bytes, made at
//! creation, never changed) encrypts blocks; it is stored only wrapped
//! (AES-256-GCM-SIV) by the user's key in the superblock's key fields
//! (`KeyWrap`, docs/FORMAT.md). The user's key is 32 raw bytes or
//! Argon2id of a passphrase. The wrap's tag is the key-check value: a wrong
//! user key fails to unwrap, before anything is read or written.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM_SIV};
use rand::RngCore;
use vouch_format::superblock::{KDF_ARGON2ID, KDF_RAW};
use vouch_format::KeyWrap;
use zeroize::Zeroizing;

use crate::error::{Error, Result};

/// Bytes of every key vouch uses (user key and data key).
pub const KEY_BYTES: usize = 32;

/// Argon2id costs for a passphrase (RFC 9106's second recommendation
/// with one lane: 64 MiB, 3 passes — about a quarter second here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KdfParams {
    pub m_cost_kib: u32,
    pub t_cost: u32,
    pub parallelism: u32,
}

impl Default for KdfParams {
    fn default() -> KdfParams {
        KdfParams {
            m_cost_kib: 64 * 1024,
            t_cost: 3,
            parallelism: 1,
        }
    }
}

/// What the user gives to open (or newly protect) an encrypted volume.
/// Never printed: `Debug` shows only which kind it is.
#[derive(Clone)]
pub enum UserSecret {
    /// A 32-byte key, used as it is.
    Key(Zeroizing<[u8; KEY_BYTES]>),
    /// A passphrase, stretched with Argon2id (the volume's salt and costs
    /// when opening; `KdfParams` and a new salt when protecting).
    Passphrase(Zeroizing<Vec<u8>>, KdfParams),
}

impl std::fmt::Debug for UserSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UserSecret::Key(_) => f.write_str("UserSecret::Key(..)"),
            UserSecret::Passphrase(..) => f.write_str("UserSecret::Passphrase(..)"),
        }
    }
}

impl UserSecret {
    /// A raw key: exactly 32 bytes, anything else is refused.
    pub fn key(bytes: &[u8]) -> Result<UserSecret> {
        let key: [u8; KEY_BYTES] = bytes.try_into().map_err(|_| {
            Error::Key(format!(
                "a key must be exactly {KEY_BYTES} raw bytes (got {}); make one with `head -c 32 /dev/urandom > FILE`",
                bytes.len()
            ))
        })?;
        Ok(UserSecret::Key(Zeroizing::new(key)))
    }

    /// A passphrase (not empty) with the default Argon2id costs.
    pub fn passphrase(passphrase: &[u8]) -> Result<UserSecret> {
        if passphrase.is_empty() {
            return Err(Error::Key("the passphrase is empty".into()));
        }
        Ok(UserSecret::Passphrase(
            Zeroizing::new(passphrase.to_vec()),
            KdfParams::default(),
        ))
    }

    /// The user's key for a volume whose key fields are `wrap`.
    fn user_key(&self, wrap: &KeyWrap) -> Result<Zeroizing<[u8; KEY_BYTES]>> {
        match self {
            UserSecret::Key(key) => Ok(key.clone()),
            UserSecret::Passphrase(passphrase, _) => {
                if wrap.kdf != KDF_ARGON2ID {
                    return Err(Error::Key(
                        "this volume's key is a raw 32-byte key, not a passphrase: give it with --key-file or VOUCH_KEY_FILE".into(),
                    ));
                }
                let params = KdfParams {
                    m_cost_kib: wrap.kdf_m_cost_kib,
                    t_cost: wrap.kdf_t_cost,
                    parallelism: wrap.kdf_parallelism,
                };
                argon2id(passphrase, &wrap.kdf_salt, params)
            }
        }
    }

    /// New key fields wrapping `data_key` under this secret (fresh wrap
    /// nonce; for a passphrase, a fresh salt and this secret's costs).
    pub(crate) fn wrap(&self, uuid: &[u8; 16], data_key: &[u8; KEY_BYTES]) -> Result<KeyWrap> {
        let mut wrap = KeyWrap::default();
        let mut rng = rand::thread_rng();
        rng.fill_bytes(&mut wrap.wrap_nonce);
        match self {
            UserSecret::Key(_) => wrap.kdf = KDF_RAW,
            UserSecret::Passphrase(_, params) => {
                wrap.kdf = KDF_ARGON2ID;
                wrap.kdf_m_cost_kib = params.m_cost_kib;
                wrap.kdf_t_cost = params.t_cost;
                wrap.kdf_parallelism = params.parallelism;
                rng.fill_bytes(&mut wrap.kdf_salt);
            }
        }
        let user_key = self.user_key(&wrap)?;
        let cipher = cipher(&user_key[..]);
        let mut sealed = *data_key;
        let tag = cipher
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(wrap.wrap_nonce),
                Aad::from(wrap_aad(uuid)),
                &mut sealed,
            )
            .map_err(|_| Error::Key("wrapping the data key failed".into()))?;
        wrap.wrapped_key = sealed;
        wrap.key_check.copy_from_slice(tag.as_ref());
        Ok(wrap)
    }

    /// The data key of a volume, or `Error::Key` if this is not its key.
    pub(crate) fn unwrap(
        &self,
        uuid: &[u8; 16],
        wrap: &KeyWrap,
    ) -> Result<Zeroizing<[u8; KEY_BYTES]>> {
        let user_key = self.user_key(wrap)?;
        let mut data_key = Zeroizing::new(wrap.wrapped_key);
        cipher(&user_key[..])
            .open_in_place_separate_tag(
                Nonce::assume_unique_for_key(wrap.wrap_nonce),
                Aad::from(wrap_aad(uuid)),
                &wrap.key_check,
                &mut data_key[..],
            )
            .map_err(|_| {
                Error::Key(
                    "wrong key: it does not unlock this volume (key check failed); nothing was read or written".into(),
                )
            })?;
        Ok(data_key)
    }
}

/// A new random data key.
pub(crate) fn new_data_key() -> Zeroizing<[u8; KEY_BYTES]> {
    let mut key = Zeroizing::new([0u8; KEY_BYTES]);
    rand::thread_rng().fill_bytes(&mut key[..]);
    key
}

/// AES-256-GCM-SIV with `key` (32 bytes).
pub(crate) fn cipher(key: &[u8]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM_SIV, key).expect("a 32-byte AES-256 key"))
}

/// Associated data of the data-key wrap: binds it to its volume.
fn wrap_aad(uuid: &[u8; 16]) -> [u8; 33] {
    let mut aad = [0u8; 33];
    aad[..17].copy_from_slice(b"vouch data key v1");
    aad[17..].copy_from_slice(uuid);
    aad
}

/// Argon2id (version 0x13) of `passphrase`.
fn argon2id(
    passphrase: &[u8],
    salt: &[u8; 16],
    params: KdfParams,
) -> Result<Zeroizing<[u8; KEY_BYTES]>> {
    let bad = |error: argon2::Error| Error::Key(format!("passphrase key derivation: {error}"));
    let params = argon2::Params::new(
        params.m_cost_kib,
        params.t_cost,
        params.parallelism,
        Some(KEY_BYTES),
    )
    .map_err(bad)?;
    let kdf = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let mut key = Zeroizing::new([0u8; KEY_BYTES]);
    kdf.hash_password_into(passphrase, salt, &mut key[..])
        .map_err(bad)?;
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cheap(passphrase: &[u8]) -> UserSecret {
        UserSecret::Passphrase(
            Zeroizing::new(passphrase.to_vec()),
            KdfParams {
                m_cost_kib: 64,
                t_cost: 1,
                parallelism: 1,
            },
        )
    }

    #[test]
    fn a_wrapped_key_opens_with_its_key_only() {
        let uuid = [7u8; 16];
        let data_key = new_data_key();
        let right = UserSecret::key(&[1u8; 32]).unwrap();
        let wrap = right.wrap(&uuid, &data_key).unwrap();
        assert_ne!(
            wrap.wrapped_key, *data_key,
            "the data key is stored encrypted"
        );
        assert_eq!(*right.unwrap(&uuid, &wrap).unwrap(), *data_key);
        let wrong = UserSecret::key(&[2u8; 32]).unwrap();
        assert!(matches!(wrong.unwrap(&uuid, &wrap), Err(Error::Key(_))));
        // Bound to the volume: the same wrap in another volume is refused.
        assert!(right.unwrap(&[8u8; 16], &wrap).is_err());
        assert!(UserSecret::key(&[0u8; 31]).is_err());
        assert!(UserSecret::key(&[0u8; 33]).is_err());
    }

    #[test]
    fn a_passphrase_is_stretched_with_the_volumes_salt() {
        let uuid = [3u8; 16];
        let data_key = new_data_key();
        let wrap = cheap(b"correct horse").wrap(&uuid, &data_key).unwrap();
        assert_eq!(wrap.kdf, KDF_ARGON2ID);
        assert_ne!(wrap.kdf_salt, [0u8; 16]);
        assert_eq!(
            *cheap(b"correct horse").unwrap(&uuid, &wrap).unwrap(),
            *data_key
        );
        assert!(cheap(b"correct horsf").unwrap(&uuid, &wrap).is_err());
        // A raw key is told that the volume wants a passphrase only by failing.
        assert!(UserSecret::key(&[0u8; 32])
            .unwrap()
            .unwrap(&uuid, &wrap)
            .is_err());
        assert!(UserSecret::passphrase(b"").is_err());
    }
}
