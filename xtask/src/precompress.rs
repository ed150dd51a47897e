//! The dashboard's files, compressed once when they are built instead of on every request.
//!
//! Beside each text asset of `web/dist` (the wasm module, the JavaScript, CSS and HTML) go a
//! `.br` (Brotli, quality 11) and a `.gz` (gzip, level 9) copy; the collector embeds them with
//! the rest and answers a browser's `Accept-Encoding` with the smallest it accepts
//! (`collector/src/api/ui.rs`). At quality 11 Brotli takes seconds on the 1.6 MB module, so a
//! compressed copy is reused while its source is byte-for-byte the one already in `web/dist`
//! (most builds change nothing). Both encoders are deterministic (gzip's header carries no time
//! or name), so an unchanged dashboard leaves `web/dist` unchanged and the collector is not
//! rebuilt.

use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// The assets worth compressing (images would not shrink).
const TEXT: [&str; 5] = ["wasm", "js", "css", "html", "json"];

/// An encoder: the whole file in, its compressed copy out.
type Encoder = fn(&[u8]) -> Result<Vec<u8>>;

/// The encodings written beside each asset: file suffix and encoder.
const ENCODINGS: [(&str, Encoder); 2] = [("br", brotli), ("gz", gzip)];

fn brotli(data: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let params = ::brotli::enc::BrotliEncoderParams {
        quality: 11,
        lgwin: 22,
        ..Default::default()
    };
    ::brotli::BrotliCompress(&mut &data[..], &mut out, &params).context("brotli")?;
    Ok(out)
}

fn gzip(data: &[u8]) -> Result<Vec<u8>> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(data)?;
    Ok(encoder.finish()?)
}

/// Writes the compressed copies of `staging`'s text assets, reusing `previous`'s (the last
/// `web/dist`) where the source file is unchanged.
pub(crate) fn dashboard(staging: &Path, previous: &Path) -> Result<()> {
    for relative in crate::files_under(staging) {
        let ext = relative.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !TEXT.contains(&ext) {
            continue;
        }
        let data = fs::read(staging.join(&relative))?;
        let unchanged = fs::read(previous.join(&relative)).ok().as_deref() == Some(&data[..]);
        for (suffix, encode) in ENCODINGS {
            let name = format!("{}.{suffix}", relative.display());
            let target = staging.join(&name);
            let kept = fs::read(previous.join(&name)).ok().filter(|_| unchanged);
            let encoded = match kept {
                Some(copy) => copy,
                None => encode(&data).with_context(|| format!("compressing {name}"))?,
            };
            // A tiny file can grow; then the file itself is the best copy.
            if encoded.len() < data.len() {
                fs::write(&target, encoded)?;
            } else if target.exists() {
                fs::remove_file(&target)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn each_copy_decodes_to_its_source_and_an_unchanged_source_reuses_its_copy() {
        let dir = tempfile::tempdir().unwrap();
        let (staging, previous) = (dir.path().join("staging"), dir.path().join("dist"));
        fs::create_dir_all(staging.join("snippets")).unwrap();
        fs::create_dir_all(&previous).unwrap();
        let module: Vec<u8> = (0..200_000u32)
            .map(|i| (i % 251) as u8 ^ (i / 977) as u8)
            .collect();
        fs::write(staging.join("app.wasm"), &module).unwrap();
        fs::write(
            staging.join("snippets/glue.js"),
            "export const a = 1;\n".repeat(50),
        )
        .unwrap();
        fs::write(staging.join("logo.png"), [0x89, b'P', b'N', b'G']).unwrap();
        dashboard(&staging, &previous).unwrap();
        let mut decoded = Vec::new();
        ::brotli::BrotliDecompress(
            &mut &fs::read(staging.join("app.wasm.br")).unwrap()[..],
            &mut decoded,
        )
        .unwrap();
        assert_eq!(decoded, module);
        let mut text = String::new();
        flate2::read::GzDecoder::new(&fs::read(staging.join("snippets/glue.js.gz")).unwrap()[..])
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "export const a = 1;\n".repeat(50));
        assert!(
            !staging.join("logo.png.br").exists(),
            "images are left alone"
        );
        fs::write(staging.join("tiny.json"), "{}").unwrap();
        dashboard(&staging, &previous).unwrap();
        assert!(
            !staging.join("tiny.json.br").exists(),
            "a copy larger than its file is not kept"
        );
        assert!(fs::metadata(staging.join("app.wasm.br")).unwrap().len() < module.len() as u64);
        // Unchanged source: the previous copy is taken as it is (a marker proves it was not
        // recompressed); a changed source is compressed again.
        fs::copy(staging.join("app.wasm"), previous.join("app.wasm")).unwrap();
        fs::write(previous.join("app.wasm.br"), b"previous copy").unwrap();
        fs::write(previous.join("app.wasm.gz"), b"previous gz").unwrap();
        let changed = "export const b = 2;\n".repeat(40);
        fs::write(staging.join("snippets/glue.js"), &changed).unwrap();
        dashboard(&staging, &previous).unwrap();
        assert_eq!(
            fs::read(staging.join("app.wasm.br")).unwrap(),
            b"previous copy"
        );
        let mut again = String::new();
        flate2::read::GzDecoder::new(&fs::read(staging.join("snippets/glue.js.gz")).unwrap()[..])
            .read_to_string(&mut again)
            .unwrap();
        assert_eq!(again, changed);
    }
}
