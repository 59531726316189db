//! AES-XTS for slots: the dm-crypt role. The key is random per swap file and
//! lives only in memory; the tweak is the slot number, so equal pages in two
//! slots encrypt differently and a slot's ciphertext cannot be moved to
//! another slot unnoticed (its checksum would fail).

use aes::cipher::generic_array::GenericArray;
use aes::cipher::KeyInit;
use aes::Aes256;
use xts_mode::{get_tweak_default, Xts128};

use crate::Slot;

pub struct Crypt {
    xts: Xts128<Aes256>,
}

impl std::fmt::Debug for Crypt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Crypt(AES-256-XTS, key withheld)")
    }
}

impl Crypt {
    /// A fresh random 512-bit XTS key (two AES-256 keys).
    ///
    /// # Errors
    /// The OS random source's error.
    pub fn random() -> Result<Crypt, getrandom::Error> {
        let mut key = [0u8; 64];
        getrandom::getrandom(&mut key)?;
        let c = Crypt {
            xts: Xts128::new(
                Aes256::new(GenericArray::from_slice(&key[..32])),
                Aes256::new(GenericArray::from_slice(&key[32..])),
            ),
        };
        key.fill(0);
        Ok(c)
    }

    /// Encrypts one page in place as one XTS sector.
    pub fn encrypt(&self, slot: Slot, page: &mut [u8]) {
        self.xts.encrypt_sector(page, get_tweak_default(u128::from(slot)));
    }

    pub fn decrypt(&self, slot: Slot, page: &mut [u8]) {
        self.xts.decrypt_sector(page, get_tweak_default(u128::from(slot)));
    }
}
