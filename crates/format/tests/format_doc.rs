//! docs/FORMAT.md is the format's single description: its byte tables must
//! match the `FIELDS` tables the encoders use.

use vouch_format::{Context, Field, JournalEntry, JournalHeader, Superblock};

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/FORMAT.md");
    std::fs::read_to_string(path).expect("docs/FORMAT.md is readable")
}

/// The (field, offset, size) rows of the first table after `heading`.
fn table_after(doc: &str, heading: &str) -> Vec<(String, usize, usize)> {
    let start = doc
        .find(heading)
        .unwrap_or_else(|| panic!("FORMAT.md has no heading {heading:?}"));
    let mut rows = Vec::new();
    let mut in_table = false;
    for line in doc[start..].lines().skip(1) {
        if line.starts_with('#') {
            break;
        }
        if !line.starts_with('|') {
            if in_table {
                break;
            }
            continue;
        }
        in_table = true;
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let (Ok(offset), Ok(size)) = (cells[0].parse::<usize>(), cells[1].parse::<usize>()) else {
            continue; // header or separator row
        };
        rows.push((cells[2].to_string(), offset, size));
    }
    rows
}

fn assert_matches(heading: &str, fields: &[Field]) {
    let rows = table_after(&doc(), heading);
    let expected: Vec<(String, usize, usize)> = fields
        .iter()
        .map(|field| (field.name.to_string(), field.offset, field.size))
        .collect();
    assert_eq!(
        rows, expected,
        "FORMAT.md table {heading:?} disagrees with the code"
    );
}

#[test]
fn superblock_table_matches_code() {
    assert_matches("## Superblock (256 bytes", Superblock::FIELDS);
}

#[test]
fn context_tables_match_code() {
    assert_matches("### Context, plain", Context::FIELDS);
    assert_matches("### Context, encrypted", Context::ENCRYPTED_FIELDS);
}

#[test]
fn journal_tables_match_code() {
    assert_matches("### Journal record header", JournalHeader::FIELDS);
    assert_matches("### Journal entry", JournalEntry::FIELDS);
}

#[test]
fn mirror_tables_match_code() {
    use vouch_format::mirror::MirrorRecord;
    assert_matches("## Mirror record", MirrorRecord::FIELDS);
    assert_matches("### Mirror member entry", MirrorRecord::ENTRY_FIELDS);
}

#[test]
fn written_map_table_matches_code() {
    use vouch_format::written::{GenerationsHeader, WrittenHeader};
    assert_matches("## Written map", WrittenHeader::FIELDS);
    assert_matches("### Generations copy header", GenerationsHeader::FIELDS);
}

#[test]
fn held_log_tables_match_code() {
    use vouch_format::held::{HeldHeader, RecordHeader, SizedWord};
    assert_matches("### Held log slot header", HeldHeader::FIELDS);
    assert_matches("### Held log slot length", SizedWord::FIELDS);
    assert_matches("### Held log record header", RecordHeader::FIELDS);
}

#[test]
fn the_checker_catches_a_wrong_row() {
    let doc = "### T\n\n| offset | size | field |\n|---|---|---|\n| 0 | 8 | magic |\n| 8 | 4 | version |\n";
    let rows = table_after(doc, "### T");
    assert_eq!(
        rows,
        vec![("magic".to_string(), 0, 8), ("version".to_string(), 8, 4)]
    );
    assert_ne!(rows[1], ("version".to_string(), 8, 8));
}

#[test]
fn feature_flag_table_matches_code() {
    let doc = doc();
    let flags = vouch_format::FeatureFlags::for_layout(vouch_format::LayoutKind::Packed);
    assert!(doc.contains("| incompat | 0 | CONTEXT_JOURNAL |"));
    assert_eq!(
        flags.incompat & vouch_format::FeatureFlags::INCOMPAT_CONTEXT_JOURNAL,
        1 << 0
    );
    assert!(doc.contains("| incompat | 1 | PACKED_LAYOUT |"));
    assert_eq!(vouch_format::FeatureFlags::INCOMPAT_PACKED_LAYOUT, 1 << 1);
    assert!(doc.contains("| incompat | 2 | ENCRYPTED |"));
    assert_eq!(vouch_format::FeatureFlags::INCOMPAT_ENCRYPTED, 1 << 2);
    assert!(doc.contains("| incompat | 3 | WRITTEN_MAP |"));
    assert_eq!(vouch_format::FeatureFlags::INCOMPAT_WRITTEN_MAP, 1 << 3);
    assert!(doc.contains("| incompat | 4 | BOUND_UNITS |"));
    assert_eq!(vouch_format::FeatureFlags::INCOMPAT_BOUND_UNITS, 1 << 4);
    assert!(doc.contains("| incompat | 6 | FENCED |"));
    assert_eq!(vouch_format::FeatureFlags::INCOMPAT_FENCED, 1 << 6);
    assert!(doc.contains("### Vacant marker (kind 5"));
    assert_eq!(vouch_format::KIND_VACANT, 5);
    assert!(doc.contains("| ro_compat | 0 | SNAPSHOT |"));
    assert_eq!(vouch_format::FeatureFlags::RO_COMPAT_SNAPSHOT, 1 << 0);
    assert!(doc.contains("| compat | 0 | HOLE_PUNCH |"));
    assert_eq!(vouch_format::FeatureFlags::COMPAT_HOLE_PUNCH, 1 << 0);
}

#[test]
fn resync_map_table_matches_code() {
    use vouch_format::dirty::DirtyHeader;
    assert_matches("## Resync map", DirtyHeader::FIELDS);
}

#[test]
fn activity_log_table_matches_code() {
    use vouch_format::activity::ActivityLog;
    assert_matches("## Activity log", ActivityLog::FIELDS);
}

#[test]
fn regions_table_matches_code() {
    use vouch_format::regions::RegionRecord;
    assert_matches("## Regions", RegionRecord::FIELDS);
}
