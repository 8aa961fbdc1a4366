//! A minimal ISO 9660 image writer: one root directory of small files, in memory.
//!
//! Enough for a NoCloud seed, and deliberately no more: no subdirectories, no boot
//! record, at most `MAX_FILES` files. The image carries two directory trees over the
//! same file data, as `genisoimage -J` writes them:
//! - the primary tree (ECMA-119) with the names upper-cased plus `.;1`
//!   (`USER-DATA.;1`), which Linux shows as `user-data` even when mounted `nojoliet`;
//! - a Joliet tree (UCS-2) with the names exactly as given, which Linux, Windows and
//!   blkid prefer.
//!
//! The output is deterministic (fixed timestamps), so the same files always make the
//! same bytes. Layout, in 2048-byte sectors: 0-15 system area, 16 primary volume
//! descriptor, 17 Joliet supplementary descriptor, 18 terminator, 19-22 path tables
//! (primary L/M, Joliet L/M), 23 primary root directory, 24 Joliet root directory, then
//! each file's data from a sector boundary.

const SECTOR: usize = 2048;
/// The most files one image holds (the root directory is one sector).
pub(crate) const MAX_FILES: usize = 8;
/// The longest file name.
pub(crate) const MAX_NAME_LEN: usize = 30;

const PRIMARY_ROOT: u32 = 23;
const JOLIET_ROOT: u32 = 24;
const FIRST_DATA: u32 = 25;
const PATH_TABLE_LEN: u32 = 10;

/// A file of the image.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct IsoFile<'a> {
    /// The file's name: 1 to [`MAX_NAME_LEN`] characters of `[a-z0-9._-]`, not `.` or
    /// `..`.
    pub name: &'a str,
    /// The file's content.
    pub data: &'a [u8],
}

impl std::fmt::Debug for IsoFile<'_> {
    // The content may be a secret (user-data): show its size only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IsoFile")
            .field("name", &self.name)
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// Why an image cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum IsoError {
    /// A volume label must be 1 to 32 characters of `[a-z0-9_]` (any case).
    #[error("volume label {0:?} must be 1 to 32 characters of [A-Za-z0-9_]")]
    Label(String),
    /// A file name is empty, `.` or `..`, too long, or has characters other than
    /// `[a-z0-9._-]`.
    #[error("file name {0:?} must be 1 to {MAX_NAME_LEN} characters of [a-z0-9._-], not . or ..")]
    Name(String),
    /// Two files have the same name.
    #[error("file name {0:?} given twice")]
    Duplicate(String),
    /// More files than [`MAX_FILES`].
    #[error("at most {MAX_FILES} files")]
    TooManyFiles,
    /// A file is larger than ISO 9660 allows in one extent.
    #[error("file {0:?} is larger than 4 GiB")]
    TooLarge(String),
}

/// Builds an image with volume label `label` holding `files` in its root directory.
pub(crate) fn build(label: &str, files: &[IsoFile<'_>]) -> Result<Vec<u8>, IsoError> {
    if label.is_empty()
        || label.len() > 32
        || !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Err(IsoError::Label(label.to_owned()));
    }
    if files.len() > MAX_FILES {
        return Err(IsoError::TooManyFiles);
    }
    let mut sorted: Vec<&IsoFile<'_>> = files.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(b.name));
    for (i, file) in sorted.iter().enumerate() {
        // `.` and `..` would name the directory itself or its parent in the Joliet tree:
        // readers return the directory, not the file.
        let valid = !matches!(file.name, "" | "." | "..")
            && file.name.len() <= MAX_NAME_LEN
            && file
                .name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
        if !valid {
            return Err(IsoError::Name(file.name.to_owned()));
        }
        if i > 0 && sorted[i - 1].name == file.name {
            return Err(IsoError::Duplicate(file.name.to_owned()));
        }
        if u32::try_from(file.data.len()).is_err() {
            return Err(IsoError::TooLarge(file.name.to_owned()));
        }
    }

    // Place each file's data; an empty file still gets a (zero-length) extent.
    let mut extents = Vec::with_capacity(sorted.len());
    let mut next = FIRST_DATA;
    for file in &sorted {
        extents.push(next);
        next += sectors(file.data.len()).max(1);
    }
    let total = next;
    let mut image = vec![0u8; total as usize * SECTOR];

    let primary = Tree {
        root: PRIMARY_ROOT,
        names: sorted
            .iter()
            .map(|f| format!("{}.;1", f.name.to_ascii_uppercase()).into_bytes())
            .collect(),
    };
    let joliet = Tree {
        root: JOLIET_ROOT,
        names: sorted.iter().map(|f| ucs2(f.name)).collect(),
    };
    write_descriptor(&mut image, 16, 1, label, total, 19, &primary);
    write_descriptor(&mut image, 17, 2, label, total, 21, &joliet);
    let terminator = &mut image[18 * SECTOR..19 * SECTOR];
    terminator[0] = 255;
    terminator[1..6].copy_from_slice(b"CD001");
    terminator[6] = 1;
    for (tree, l_table) in [(&primary, 19u32), (&joliet, 21)] {
        write_path_table(&mut image, l_table, tree.root, false);
        write_path_table(&mut image, l_table + 1, tree.root, true);
        let mut dir = Vec::with_capacity(SECTOR);
        dir.extend(record(tree.root, SECTOR as u32, true, &[0]));
        dir.extend(record(tree.root, SECTOR as u32, true, &[1]));
        for ((name, file), extent) in tree.names.iter().zip(&sorted).zip(&extents) {
            dir.extend(record(*extent, file.data.len() as u32, false, name));
        }
        assert!(
            dir.len() <= SECTOR,
            "MAX_FILES and MAX_NAME_LEN keep the root in one sector"
        );
        let at = tree.root as usize * SECTOR;
        image[at..at + dir.len()].copy_from_slice(&dir);
    }
    for (file, extent) in sorted.iter().zip(&extents) {
        let at = *extent as usize * SECTOR;
        image[at..at + file.data.len()].copy_from_slice(file.data);
    }
    Ok(image)
}

struct Tree {
    root: u32,
    names: Vec<Vec<u8>>,
}

fn sectors(len: usize) -> u32 {
    u32::try_from(len.div_ceil(SECTOR)).unwrap_or(u32::MAX)
}

fn ucs2(text: &str) -> Vec<u8> {
    text.encode_utf16().flat_map(u16::to_be_bytes).collect()
}

fn both_u32(value: u32) -> [u8; 8] {
    let mut out = [0; 8];
    out[..4].copy_from_slice(&value.to_le_bytes());
    out[4..].copy_from_slice(&value.to_be_bytes());
    out
}

fn both_u16(value: u16) -> [u8; 4] {
    let mut out = [0; 4];
    out[..2].copy_from_slice(&value.to_le_bytes());
    out[2..].copy_from_slice(&value.to_be_bytes());
    out
}

/// A directory record. The recording date is fixed (1970-01-01, UTC).
fn record(extent: u32, len: u32, directory: bool, name: &[u8]) -> Vec<u8> {
    let pad = usize::from(name.len().is_multiple_of(2));
    let mut r = vec![0u8; 33 + name.len() + pad];
    r[0] = r.len() as u8;
    r[2..10].copy_from_slice(&both_u32(extent));
    r[10..18].copy_from_slice(&both_u32(len));
    r[18..25].copy_from_slice(&[70, 1, 1, 0, 0, 0, 0]);
    r[25] = if directory { 2 } else { 0 };
    r[28..32].copy_from_slice(&both_u16(1));
    r[32] = name.len() as u8;
    r[33..33 + name.len()].copy_from_slice(name);
    r
}

fn write_path_table(image: &mut [u8], sector: u32, root: u32, big_endian: bool) {
    let at = sector as usize * SECTOR;
    let entry = &mut image[at..at + PATH_TABLE_LEN as usize];
    entry[0] = 1;
    if big_endian {
        entry[2..6].copy_from_slice(&root.to_be_bytes());
        entry[6..8].copy_from_slice(&1u16.to_be_bytes());
    } else {
        entry[2..6].copy_from_slice(&root.to_le_bytes());
        entry[6..8].copy_from_slice(&1u16.to_le_bytes());
    }
}

/// A primary (`kind` 1) or Joliet supplementary (`kind` 2) volume descriptor.
fn write_descriptor(
    image: &mut [u8],
    sector: u32,
    kind: u8,
    label: &str,
    total: u32,
    l_table: u32,
    tree: &Tree,
) {
    let joliet = kind == 2;
    // a-/d-character fields are padded with spaces; Joliet's with UCS-2 spaces.
    let text = |field: &mut [u8], value: &str| {
        let bytes = if joliet {
            ucs2(value)
        } else {
            value.as_bytes().to_vec()
        };
        let pad: &[u8] = if joliet { &[0, b' '] } else { b" " };
        for (i, byte) in field.iter_mut().enumerate() {
            *byte = bytes
                .get(i)
                .copied()
                .unwrap_or_else(|| pad[(i - bytes.len()) % pad.len()]);
        }
    };
    let d = &mut image[sector as usize * SECTOR..(sector as usize + 1) * SECTOR];
    d[0] = kind;
    d[1..6].copy_from_slice(b"CD001");
    d[6] = 1;
    text(&mut d[8..40], "LINUX");
    text(&mut d[40..72], label);
    d[80..88].copy_from_slice(&both_u32(total));
    if joliet {
        // UCS-2 level 3.
        d[88..91].copy_from_slice(b"%/E");
    }
    d[120..124].copy_from_slice(&both_u16(1));
    d[124..128].copy_from_slice(&both_u16(1));
    d[128..132].copy_from_slice(&both_u16(SECTOR as u16));
    d[132..140].copy_from_slice(&both_u32(PATH_TABLE_LEN));
    d[140..144].copy_from_slice(&l_table.to_le_bytes());
    d[148..152].copy_from_slice(&(l_table + 1).to_be_bytes());
    let root = record(tree.root, SECTOR as u32, true, &[0]);
    d[156..156 + root.len()].copy_from_slice(&root);
    for (from, to) in [(190, 318), (318, 446), (446, 574), (574, 702)] {
        text(&mut d[from..to], "");
    }
    for (from, to) in [(702, 739), (739, 776), (776, 813)] {
        text(&mut d[from..to], "");
    }
    // Creation, modification, expiration, effective: "not specified".
    for at in [813, 830, 847, 864] {
        d[at..at + 16].copy_from_slice(b"0000000000000000");
        d[at + 16] = 0;
    }
    d[881] = 1;
}

#[cfg(test)]
mod properties;

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_le(image: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(image[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn descriptors_and_files_are_where_the_standard_puts_them() {
        let image = build(
            "cidata",
            &[
                IsoFile {
                    name: "user-data",
                    data: b"#cloud-config\n",
                },
                IsoFile {
                    name: "meta-data",
                    data: b"instance-id: x\n",
                },
            ],
        )
        .unwrap();
        assert_eq!(image.len() % SECTOR, 0);
        let pvd = &image[16 * SECTOR..];
        assert_eq!(&pvd[..7], b"\x01CD001\x01");
        assert_eq!(&pvd[40..46], b"cidata");
        assert_eq!(u32_le(pvd, 80) as usize * SECTOR, image.len());
        let svd = &image[17 * SECTOR..];
        assert_eq!(&svd[..7], b"\x02CD001\x01");
        assert_eq!(&svd[88..91], b"%/E");
        assert_eq!(&svd[40..52], &ucs2("cidata")[..]);
        assert_eq!(image[18 * SECTOR], 255);
        // Files are sorted by name: meta-data first.
        let data = &image[FIRST_DATA as usize * SECTOR..];
        assert!(data.starts_with(b"instance-id: x\n"));
        let user = &image[(FIRST_DATA as usize + 1) * SECTOR..];
        assert!(user.starts_with(b"#cloud-config\n"));
        let root = &image[PRIMARY_ROOT as usize * SECTOR..];
        let names = String::from_utf8_lossy(&root[..200]);
        assert!(
            names.contains("META-DATA.;1") && names.contains("USER-DATA.;1"),
            "{names}"
        );
    }

    #[test]
    fn dot_and_dot_dot_are_not_file_names() {
        for name in [".", ".."] {
            assert_eq!(
                build("x", &[IsoFile { name, data: b"" }]),
                Err(IsoError::Name(name.to_owned()))
            );
        }
        build(
            "x",
            &[IsoFile {
                name: "...",
                data: b"",
            }],
        )
        .unwrap();
    }

    #[test]
    fn output_is_deterministic_and_empty_files_are_allowed() {
        let files = [
            IsoFile {
                name: "a",
                data: b"",
            },
            IsoFile {
                name: "b",
                data: &[7u8; 5000],
            },
        ];
        let one = build("x", &files).unwrap();
        assert_eq!(one, build("x", &files).unwrap());
        assert_eq!(one.len(), (FIRST_DATA as usize + 1 + 3) * SECTOR);
    }

    #[test]
    fn bad_labels_and_names_are_refused() {
        let file = |name| IsoFile { name, data: b"" };
        assert_eq!(build("", &[]), Err(IsoError::Label(String::new())));
        assert!(matches!(build("a-b", &[]), Err(IsoError::Label(_))));
        let too_long = "n".repeat(MAX_NAME_LEN + 1);
        for name in ["", "UPPER", "a/b", "a b", &too_long] {
            assert!(
                matches!(build("x", &[file(name)]), Err(IsoError::Name(_))),
                "{name}"
            );
        }
        assert!(matches!(
            build("x", &[file("a"), file("a")]),
            Err(IsoError::Duplicate(_))
        ));
        let many = vec![file("a"); MAX_FILES + 1];
        assert_eq!(build("x", &many), Err(IsoError::TooManyFiles));
    }

    #[test]
    fn the_largest_root_directory_fits_one_sector() {
        let names: Vec<String> = (0..MAX_FILES)
            .map(|i| format!("{i}{}", "n".repeat(MAX_NAME_LEN - 1)))
            .collect();
        let files: Vec<IsoFile<'_>> = names
            .iter()
            .map(|n| IsoFile {
                name: n,
                data: b"x",
            })
            .collect();
        build("cidata", &files).unwrap();
    }
}
