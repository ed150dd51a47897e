//! Rebuilds the collector when the dashboard it embeds (`web/dist`, from `cargo xtask web`)
//! changes: rust-embed includes the files, but cargo would not otherwise look at them.

fn main() {
    // Cargo treats a missing watched path as always changed, which would rebuild the collector
    // on every build before the dashboard exists; an empty (git-ignored) folder is stable.
    let dist = std::path::Path::new("../web/dist");
    if !dist.exists() {
        let _ = std::fs::create_dir_all(dist);
    }
    println!("cargo:rerun-if-changed=../web/dist");
}
