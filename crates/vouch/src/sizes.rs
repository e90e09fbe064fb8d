//! Sizes on the command line (`--size`, `--journal`, rates, offsets):
//! how every size option reads. A leaf: the commands and `main` import it.

/// Parse sizes like 10GiB, 512MiB, 4k, 1048576. A bare K, M, G, T, P or E
/// is a power of 1024 (4K = 4096, like dd and qemu-img); KB, MB... are
/// powers of 1000.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    if let Ok(bytes) = trimmed.parse::<u64>() {
        return Ok(bytes);
    }
    let binary;
    let trimmed = match trimmed.chars().last() {
        Some(unit) if "kKmMgGtTpPeE".contains(unit) => {
            binary = format!("{trimmed}iB");
            binary.as_str()
        }
        _ => trimmed,
    };
    let bytes = trimmed
        .parse::<bytesize::ByteSize>()
        .map(|size| size.as_u64())
        .map_err(|_| format!("'{text}' is not a size (examples: 10GiB, 512MiB, 1048576)"))?;
    // A unit size past 2^64 - 1 bytes saturates instead of failing to parse.
    if bytes == u64::MAX {
        return Err(format!(
            "'{text}' is too large (sizes are at most 16 EiB - 1 byte)"
        ));
    }
    Ok(bytes)
}

/// `text` and the bytes `parse_size` read it as, for an error about those
/// bytes: "{text} is {what}", where a decimal unit says so, since taking
/// 2GB for 2 GiB is the usual mistake: "2GB is 2000000000 bytes (GB is
/// decimal; G and GiB are 1024-based): not a multiple of 4096".
fn size_is(text: &str, bytes: u64, what: &str) -> String {
    let text = text.trim();
    if text.parse::<u64>().is_ok() {
        return format!("{text} is {what}");
    }
    let unit = text.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.' || c == ' ');
    let mut letters = unit.chars();
    match (letters.next(), letters.next(), letters.next()) {
        (Some(prefix), Some('b' | 'B'), None) if "kKmMgGtTpPeE".contains(prefix) => {
            let prefix = prefix.to_ascii_uppercase();
            format!("{text} is {bytes} bytes ({unit} is decimal; {prefix} and {prefix}iB are 1024-based): {what}")
        }
        _ => format!("{text} is {bytes} bytes: {what}"),
    }
}

/// A volume's size (`create --size`, `serve --create`): `parse_size`, then
/// at most the largest volume and a positive multiple of 4096 bytes, told
/// in the user's own unit.
pub fn parse_volume_size(text: &str) -> Result<u64, String> {
    let bytes = parse_size(text)?;
    if bytes > vouch_engine::MAX_VOLUME_BYTES {
        return Err(size_is(
            text,
            bytes,
            "larger than the largest volume vouch supports (1 PiB)",
        ));
    }
    if bytes == 0 || !bytes.is_multiple_of(vouch_engine::BLOCK) {
        return Err(size_is(text, bytes, "not a positive multiple of 4096"));
    }
    Ok(bytes)
}

/// An offset or length in a volume (verify, copy, compare): `parse_size`,
/// then a multiple of 4096 bytes, told in the user's own unit.
pub fn parse_block_bytes(text: &str) -> Result<u64, String> {
    let bytes = parse_size(text)?;
    if !bytes.is_multiple_of(vouch_engine::BLOCK) {
        return Err(size_is(text, bytes, "not a multiple of 4096"));
    }
    Ok(bytes)
}
