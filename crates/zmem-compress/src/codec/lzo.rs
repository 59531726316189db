//! LZO1X-1 and the kernel's LZO-RLE, written clean-room from the stream
//! description in the kernel's `Documentation/staging/lzo.rst`.
//!
//! No permissively licensed lzo crate exists, so this file implements both
//! directions. The compressor is a greedy single-probe hash matcher in the
//! spirit of lzo1x-1; the decoder accepts every stream that the description
//! allows, and is written in safe Rust so that no input can make it read or
//! write out of bounds.
//!
//! # Stream recap (see lzo.rst for the full table)
//! - First byte `> 17`: a literal run of `byte - 17` bytes. With LZO-RLE the
//!   stream starts with `17, 1` (the bitstream version), then the same rule.
//! - `0000LLLL` after an instruction that left `state == 0`: a literal run.
//! - `0000DDSS` with `state` 1..3 or 4: a 2- or 3-byte copy (M1; never emitted).
//! - `01LDDDSS H` / `1LLDDDSS H`: copy 3..8 bytes within 2 KiB (M2).
//! - `001LLLLL [ext] LE16`: copy within 16 KiB (M3).
//! - `0001HLLL [ext] LE16`: copy at 16..48 KiB (M4); distance 16384 is the end
//!   of stream (`0x11 0x00 0x00`). In version 1, `00011LLL 0xfc|SS 0xff X`
//!   (distance 0xbfff) is a run of `((X << 3) | LLL) + 4` zero bytes.
//! - The low two bits `SS` of the instruction (or of its LE16) say how many
//!   literals (0..3) follow it; four or more need their own literal run.

use super::{bounded_dst, Compressor};
use crate::{CompressError, DecompressError};

/// Bitstream version: plain LZO1X, or LZO-RLE (version 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V0,
    Rle,
}

const HASH_BITS: u32 = 12;
/// M4 reaches 49151, but in version 1 that distance is the RLE marker, so
/// both versions stop one short (the compressor choice is free).
const MAX_DISTANCE: usize = 49150;
const M2_MAX_DISTANCE: usize = 2048;
const M3_MAX_DISTANCE: usize = 16384;
const MIN_ZERO_RUN: usize = 4;
const MAX_ZERO_RUN: usize = (255 << 3) + 7 + MIN_ZERO_RUN;

/// An lzo or lzo-rle compressor with its match table.
#[derive(Debug)]
pub struct Lzo {
    version: Version,
    /// Last position of each 4-byte hash, stored as `base + position`.
    /// Entries below `base` belong to earlier calls and are ignored, so the
    /// table needs no clearing per page, and the output depends on the input
    /// alone (engines and the software path must agree byte for byte).
    table: Box<[u32]>,
    base: u32,
}

impl Lzo {
    pub fn new(version: Version) -> Self {
        Lzo { version, table: vec![0u32; 1 << HASH_BITS].into_boxed_slice(), base: 1 }
    }
}

impl Compressor for Lzo {
    fn name(&self) -> &str {
        match self.version {
            Version::V0 => "lzo",
            Version::Rle => "lzo-rle",
        }
    }

    fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError> {
        let out = bounded_dst(src, dst)?;
        if src.len() >= (u32::MAX - self.base) as usize {
            if src.len() >= (u32::MAX / 2) as usize {
                return Err(CompressError::Codec { codec: "lzo", msg: "input of 2 GiB or more".into() });
            }
            self.table.fill(0);
            self.base = 1;
        }
        let r = compress(self.version, &mut self.table, self.base, src, out).ok_or(CompressError::Poor);
        self.base += src.len() as u32 + 1;
        r
    }

    fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
        let codec = self.name_static();
        decompress(src, dst).map_err(|e| match e {
            DecodeError::Corrupt => DecompressError::Corrupt { codec },
            DecodeError::Overrun => DecompressError::Overrun { codec, cap: dst.len() },
        })
    }
}

impl Lzo {
    fn name_static(&self) -> &'static str {
        match self.version {
            Version::V0 => "lzo",
            Version::Rle => "lzo-rle",
        }
    }
}

// ---------------------------------------------------------------------------
// Compressor
// ---------------------------------------------------------------------------

/// The output was full: the caller reports `Poor`.
struct Full;

struct Writer<'a> {
    out: &'a mut [u8],
    pos: usize,
    /// Where the two `SS` bits of the last instruction live, or `None` before
    /// the first instruction (literals then use the first-byte encoding).
    s_pos: Option<usize>,
}

impl Writer<'_> {
    #[inline]
    fn byte(&mut self, b: u8) -> Result<(), Full> {
        *self.out.get_mut(self.pos).ok_or(Full)? = b;
        self.pos += 1;
        Ok(())
    }

    #[inline]
    fn bytes(&mut self, b: &[u8]) -> Result<(), Full> {
        let end = self.pos + b.len();
        self.out.get_mut(self.pos..end).ok_or(Full)?.copy_from_slice(b);
        self.pos = end;
        Ok(())
    }

    /// The variable-length tail of a length whose opcode field was zero:
    /// `r - 1` expressed as 255s, then the remainder (1..=255).
    fn ext(&mut self, r: usize) -> Result<(), Full> {
        debug_assert!(r >= 1);
        let zeros = (r - 1) / 255;
        for _ in 0..zeros {
            self.byte(0)?;
        }
        self.byte((r - zeros * 255) as u8)
    }

    /// A length in an opcode field of `mask` bits worth, biased by `base`.
    fn len_field(&mut self, op: u8, len: usize, base: usize, mask: usize) -> Result<(), Full> {
        let v = len - base;
        if v <= mask {
            self.byte(op | v as u8)
        } else {
            self.byte(op)?;
            self.ext(v - mask)
        }
    }

    fn le16(&mut self, v: usize) -> Result<(), Full> {
        self.s_pos = Some(self.pos);
        self.byte(v as u8)?;
        self.byte((v >> 8) as u8)
    }

    /// Emits the literals pending before the next instruction.
    fn literals(&mut self, lit: &[u8]) -> Result<(), Full> {
        let n = lit.len();
        if n == 0 {
            return Ok(());
        }
        match self.s_pos {
            // First-byte encoding: 18..=255 is a run of 1..=238 literals.
            None if n <= 238 => self.byte(17 + n as u8)?,
            // 1..3 literals ride in the SS bits of the previous instruction.
            Some(sp) if n <= 3 => self.out[sp] |= n as u8,
            // A literal run; the previous instruction left SS = 0.
            _ => self.len_field(0, n, 3, 15)?,
        }
        self.bytes(lit)
    }

    fn copy(&mut self, version: Version, dist: usize, mut len: usize) -> Result<usize, Full> {
        debug_assert!((1..=MAX_DISTANCE).contains(&dist) && len >= 3);
        if len <= 8 && dist <= M2_MAX_DISTANCE {
            let d = dist - 1;
            let op = if len <= 4 { 0x40 | ((len - 3) << 5) } else { 0x80 | ((len - 5) << 5) };
            self.s_pos = Some(self.pos);
            self.byte((op | ((d & 7) << 2)) as u8)?;
            self.byte((d >> 3) as u8)?;
        } else if dist <= M3_MAX_DISTANCE {
            self.len_field(0x20, len, 2, 31)?;
            self.le16((dist - 1) << 2)?;
        } else {
            // Version 1 reserves these (length, distance) pairs, whose bytes
            // would read as a zero run; shorten the copy instead.
            if version == Version::Rle && (dist & 0x803f) == 0x803f && (261..=264).contains(&len) {
                len = 260;
            }
            let d = dist - 16384;
            self.len_field(0x10 | ((d >> 14) << 3) as u8, len, 2, 7)?;
            self.le16((d & 0x3fff) << 2)?;
        }
        Ok(len)
    }

    fn zero_run(&mut self, run: usize) -> Result<(), Full> {
        debug_assert!((MIN_ZERO_RUN..=MAX_ZERO_RUN).contains(&run));
        let r = run - MIN_ZERO_RUN;
        self.byte(0x18 | (r & 7) as u8)?;
        self.le16(0xfffc)?;
        self.byte((r >> 3) as u8)
    }
}

#[inline]
fn read32(s: &[u8], i: usize) -> u32 {
    // One bounds check instead of four.
    let b: &[u8; 4] = s[i..i + 4].try_into().unwrap_or(&[0; 4]);
    u32::from_le_bytes(*b)
}

#[inline]
fn hash(v: u32) -> usize {
    (v.wrapping_mul(0x9E37_79B1) >> (32 - HASH_BITS)) as usize
}

/// Length of the common prefix of `s[a..]` and `s[b..]`, with `a < b`.
#[inline]
fn common(s: &[u8], mut a: usize, mut b: usize) -> usize {
    let start = b;
    while b + 8 <= s.len() {
        let x = u64::from_le_bytes(*<&[u8; 8]>::try_from(&s[a..a + 8]).unwrap_or(&[0; 8]));
        let y = u64::from_le_bytes(*<&[u8; 8]>::try_from(&s[b..b + 8]).unwrap_or(&[1; 8]));
        let diff = x ^ y;
        if diff != 0 {
            return b - start + (diff.trailing_zeros() / 8) as usize;
        }
        a += 8;
        b += 8;
    }
    while b < s.len() && s[a] == s[b] {
        a += 1;
        b += 1;
    }
    b - start
}

/// Compresses `src` into `out`; `None` when `out` is too small.
fn compress(version: Version, table: &mut [u32], base: u32, src: &[u8], out: &mut [u8]) -> Option<usize> {
    compress_inner(version, table, base as usize, src, out).ok()
}

fn compress_inner(version: Version, table: &mut [u32], base: usize, src: &[u8], out: &mut [u8]) -> Result<usize, Full> {
    let n = src.len();
    let mut w = Writer { out, pos: 0, s_pos: None };
    if version == Version::Rle {
        w.bytes(&[17, 1])?;
    }
    let mut anchor = 0usize;
    // Position 0 can start neither a copy (no history) nor a zero run (the
    // first byte's encoding has no room for one), so scanning starts at 1.
    let mut ip = 1usize;
    while ip + 4 <= n {
        let v = read32(src, ip);
        if version == Version::Rle && v == 0 {
            let run = 4 + src[ip + 4..].iter().take_while(|&&b| b == 0).count();
            w.literals(&src[anchor..ip])?;
            let mut left = run;
            while left >= MIN_ZERO_RUN {
                let chunk = left.min(MAX_ZERO_RUN);
                w.zero_run(chunk)?;
                left -= chunk;
            }
            ip += run - left;
            anchor = ip;
            continue;
        }
        let h = hash(v);
        let entry = table[h] as usize;
        table[h] = (base + ip) as u32;
        // `entry < base` is an earlier call's (or an empty) slot: no candidate.
        let cand = entry.wrapping_sub(base);
        if entry >= base && cand < ip && ip - cand <= MAX_DISTANCE && read32(src, cand) == v {
            let len = 4 + common(src, cand + 4, ip + 4);
            w.literals(&src[anchor..ip])?;
            let len = w.copy(version, ip - cand, len)?;
            ip += len;
            anchor = ip;
        } else {
            // Skip faster through input that does not match (as lzo1x-1 does).
            ip += 1 + ((ip - anchor) >> 5);
        }
    }
    w.literals(&src[anchor..])?;
    // End of stream: an M4 copy of distance 16384, i.e. 0x11 0x00 0x00.
    w.bytes(&[0x11, 0, 0])?;
    Ok(w.pos)
}

// ---------------------------------------------------------------------------
// Decompressor
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodeError {
    Corrupt,
    Overrun,
}

struct Reader<'a> {
    src: &'a [u8],
    ip: usize,
}

impl Reader<'_> {
    #[inline]
    fn byte(&mut self) -> Result<usize, DecodeError> {
        let b = *self.src.get(self.ip).ok_or(DecodeError::Corrupt)?;
        self.ip += 1;
        Ok(b as usize)
    }

    #[inline]
    fn le16(&mut self) -> Result<usize, DecodeError> {
        Ok(self.byte()? | (self.byte()? << 8))
    }

    /// The variable-length extension of a zero length field worth `mask`.
    fn ext(&mut self, mask: usize) -> Result<usize, DecodeError> {
        let mut len = mask;
        loop {
            match self.byte()? {
                0 => len += 255,
                b => return Ok(len + b),
            }
        }
    }
}

/// Decodes an lzo or lzo-rle stream into `dst`, returning the output length.
pub(crate) fn decompress(src: &[u8], dst: &mut [u8]) -> Result<usize, DecodeError> {
    let mut r = Reader { src, ip: 0 };
    let mut op = 0usize;
    let mut version = 0;
    if src.len() >= 5 && src[0] == 17 {
        version = src[1];
        if version > 1 {
            return Err(DecodeError::Corrupt);
        }
        r.ip = 2;
    }

    let literals = |r: &mut Reader<'_>, dst: &mut [u8], op: &mut usize, n: usize| {
        let s = r.src.get(r.ip..r.ip + n).ok_or(DecodeError::Corrupt)?;
        dst.get_mut(*op..*op + n).ok_or(DecodeError::Overrun)?.copy_from_slice(s);
        r.ip += n;
        *op += n;
        Ok::<(), DecodeError>(())
    };

    let mut state = 0usize;
    if let Some(&first) = src.get(r.ip) {
        if first > 17 {
            r.ip += 1;
            let n = first as usize - 17;
            literals(&mut r, dst, &mut op, n)?;
            state = n.min(4);
        }
    }

    loop {
        let t = r.byte()?;
        let (dist, len, s);
        if t < 16 {
            match state {
                0 => {
                    let n = 3 + if t != 0 { t } else { r.ext(15)? };
                    literals(&mut r, dst, &mut op, n)?;
                    state = 4;
                    continue;
                }
                1..=3 => {
                    dist = (r.byte()? << 2) + ((t >> 2) & 3) + 1;
                    len = 2;
                }
                _ => {
                    dist = (r.byte()? << 2) + ((t >> 2) & 3) + 2049;
                    len = 3;
                }
            }
            s = t & 3;
        } else if t < 32 {
            if version == 1 && (t & 0xf8) == 0x18 {
                let peek = src.get(r.ip..r.ip + 2).map(|b| b[0] as usize | (b[1] as usize) << 8);
                if peek.is_some_and(|v| v & 0xfffc == 0xfffc) {
                    let v = r.le16()?;
                    let run = ((r.byte()? << 3) | (t & 7)) + MIN_ZERO_RUN;
                    dst.get_mut(op..op + run).ok_or(DecodeError::Overrun)?.fill(0);
                    op += run;
                    state = v & 3;
                    literals(&mut r, dst, &mut op, state)?;
                    continue;
                }
            }
            len = 2 + if t & 7 != 0 { t & 7 } else { r.ext(7)? };
            let v = r.le16()?;
            let d = ((t & 8) << 11) + (v >> 2);
            if d == 0 {
                // End of stream: only `0x11 0x00 0x00`, and nothing after it.
                return if len == 3 && v == 0 && r.ip == src.len() { Ok(op) } else { Err(DecodeError::Corrupt) };
            }
            dist = 16384 + d;
            s = v & 3;
        } else if t < 64 {
            len = 2 + if t & 31 != 0 { t & 31 } else { r.ext(31)? };
            let v = r.le16()?;
            dist = (v >> 2) + 1;
            s = v & 3;
        } else {
            len = if t < 128 { 3 + ((t >> 5) & 1) } else { 5 + ((t >> 5) & 3) };
            dist = (r.byte()? << 3) + ((t >> 2) & 7) + 1;
            s = t & 3;
        }

        if dist > op {
            return Err(DecodeError::Corrupt);
        }
        if op + len > dst.len() {
            return Err(DecodeError::Overrun);
        }
        let from = op - dist;
        if dist >= len && len <= 16 {
            // Short copies (most M2s) are cheaper by hand than a memmove call.
            let (head, tail) = dst.split_at_mut(op);
            for (d, s) in tail[..len].iter_mut().zip(&head[from..from + len]) {
                *d = *s;
            }
        } else if dist >= len {
            dst.copy_within(from..from + len, op);
        } else if dist == 1 {
            let b = dst[from];
            dst[op..op + len].fill(b);
        } else {
            for i in 0..len {
                dst[op + i] = dst[from + i];
            }
        }
        op += len;
        literals(&mut r, dst, &mut op, s)?;
        state = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(version: Version, data: &[u8]) -> Option<usize> {
        let mut c = Lzo::new(version);
        let mut out = vec![0u8; data.len().max(1)];
        let n = c.compress(data, &mut out).ok()?;
        let mut back = vec![0u8; data.len()];
        let m = c.decompress(&out[..n], &mut back).expect("decompress own output");
        assert_eq!(&back[..m], data);
        Some(n)
    }

    #[test]
    fn end_of_stream_alone_is_empty() {
        assert_eq!(decompress(&[0x11, 0, 0], &mut [0u8; 4]), Ok(0));
    }

    #[test]
    fn zero_page_is_tiny_with_rle() {
        let page = [0u8; 4096];
        let v0 = roundtrip(Version::V0, &page).unwrap();
        let rle = roundtrip(Version::Rle, &page).unwrap();
        assert!(rle < 16, "lzo-rle zero page took {rle} bytes");
        assert!(v0 < 64, "lzo zero page took {v0} bytes");
    }

    #[test]
    fn long_literal_runs_and_far_copies() {
        // 60 KiB: incompressible head, then a repeat at > 16 KiB distance (M4).
        let mut x = 0x1234_5678u32;
        let mut data: Vec<u8> = (0..20000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        let head = data[..20000].to_vec();
        data.extend_from_slice(&head);
        data.extend(std::iter::repeat_n(0u8, 5000));
        data.extend_from_slice(&head[..3000]);
        for v in [Version::V0, Version::Rle] {
            assert!(roundtrip(v, &data).is_some());
        }
    }

    #[test]
    fn trailing_garbage_is_corrupt() {
        assert_eq!(decompress(&[0x11, 0, 0, 0], &mut [0u8; 4]), Err(DecodeError::Corrupt));
    }
}
