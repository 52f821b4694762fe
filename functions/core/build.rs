//! `db` embeds `migrations/` at compile time (`refinery::embed_migrations!`), which cargo does
//! not know about: without this, a new or edited migration file is missed until some Rust
//! source of this crate changes.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
