//! GPU benchmark over the FA3-paper grid (placeholder until the Hopper forward kernel lands).
fn main() {
    println!("gpu_attention: no GPU kernel yet");
}
