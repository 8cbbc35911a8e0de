//! Matrix-multiply throughput of the batch-invariant kernel at several row
//! counts, single-threaded and on the math pool.
//!
//! `kernel_bench [K] [N]` (defaults: 576 x 1536, an SmolLM2 MLP projection).

use std::time::Instant;

use pdkv_model::kernels::{matmul, thread_pool};

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().expect("numeric argument"));
    let k = args.next().unwrap_or(576);
    let n = args.next().unwrap_or(1536);
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
        .collect();
    for m in [1usize, 4, 8, 32, 128] {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) * 1e-2)
            .collect();
        let mut y = vec![0f32; m * n];
        let reps = (2_000_000_000 / (2 * m * n * k)).clamp(3, 2000);
        // One thread, timed by the CPU time this thread got (robust on a busy host).
        let single = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let (wall1, cpu1) = single.install(|| {
            matmul(&x, m, k, &w, n, &mut y);
            let (t, c) = (Instant::now(), thread_cpu_ns());
            for _ in 0..reps {
                matmul(&x, m, k, &w, n, &mut y);
            }
            (
                t.elapsed().as_secs_f64() / reps as f64,
                (thread_cpu_ns() - c) as f64 * 1e-9 / reps as f64,
            )
        });
        let wall = thread_pool().install(|| {
            matmul(&x, m, k, &w, n, &mut y);
            let t = Instant::now();
            for _ in 0..reps {
                matmul(&x, m, k, &w, n, &mut y);
            }
            t.elapsed().as_secs_f64() / reps as f64
        });
        let gf = |t: f64| 2.0 * (m * n * k) as f64 / t / 1e9;
        println!(
            "m={m:>4} k={k} n={n}: 1 thread {:>8.1} us wall, {:>8.1} us cpu ({:>5.1} GFLOP/s per cpu-second); pool {:>8.1} us ({:>5.1} GFLOP/s)",
            wall1 * 1e6,
            cpu1 * 1e6,
            gf(cpu1),
            wall * 1e6,
            gf(wall)
        );
    }
}

/// Nanoseconds this thread has run on a CPU (Linux schedstat).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}
