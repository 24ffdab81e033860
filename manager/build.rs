//! Rebuilds the manager when the dashboard's built assets change, so `rust-embed` picks them up.
fn main() {
    println!("cargo:rerun-if-changed=../dashboard/dist");
}
