//! `kiln serve --jobs-db` on the bundled tiny model over loopback, stopped with jobs in flight
//! and started again on the same store: after SIGTERM (the running job finishes, the queued ones
//! wait on disk) and after SIGKILL (the running job is run again), every job id the first server
//! accepted resolves on the second, done with the image an uninterrupted run makes. Every wait is
//! bounded.

mod serving;

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serving::{agent, decode_png, get, job_png, post, temp_dir, wait_done, Served};

/// A long job first (it runs while the others wait: --max-batch 1), then three short ones.
fn bodies() -> Vec<Value> {
    let mut bodies =
        vec![json!({"prompt": "a long red circle", "num_inference_steps": 30, "width": 128, "height": 128, "seed": 1})];
    bodies.extend(
        (0..3).map(|k| json!({"prompt": format!("short job {k}"), "num_inference_steps": 2, "width": 64, "height": 64, "seed": 10 + k})),
    );
    bodies
}

fn submit(served: &Served, body: &Value) -> String {
    let (code, job, _) = post(&served.url("/kiln/v1/jobs"), body);
    assert_eq!(code, 202, "{job}");
    job["id"].as_str().unwrap().to_string()
}

fn start(db: &Path) -> Served {
    Served::start(&["--max-batch", "1", "--jobs-db", db.to_str().unwrap()])
}

/// Submits the jobs, waits for the long one to be past its first step, stops the server with
/// `stop`, starts another on the same store and checks every job there; (seconds the second
/// server took to end them all).
fn restart_with(name: &str, stop: impl FnOnce(Served)) -> f64 {
    let dir = temp_dir(name);
    let db = dir.join("jobs.sqlite");
    let first = start(&db);
    let ids: Vec<String> = bodies().iter().map(|b| submit(&first, b)).collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    while get(&first.url(&format!("/kiln/v1/jobs/{}", ids[0])))["step"].as_u64() < Some(1) {
        assert!(Instant::now() < deadline, "the long job did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    for id in &ids[1..] {
        assert_eq!(get(&first.url(&format!("/kiln/v1/jobs/{id}")))["status"], "queued");
    }
    stop(first);

    let second = start(&db);
    let started = Instant::now();
    // (stderr is read by a thread of its own: its line may come after the address.)
    let deadline = Instant::now() + Duration::from_secs(10);
    while !second.stderr.lock().unwrap().contains("queued again") {
        assert!(Instant::now() < deadline, "{}", second.stderr.lock().unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    let jobs: Vec<Value> = ids.iter().map(|id| wait_done(&second, id)).collect();
    let took = started.elapsed().as_secs_f64();
    for (job, id) in jobs.iter().zip(&ids) {
        assert_eq!(job["status"], "done", "job {id}: {job}");
        assert_eq!(job["id"], id.as_str());
    }
    // The images are those of an uninterrupted run of the same requests.
    for (body, job) in bodies().iter().zip(&jobs) {
        let again = wait_done(&second, &submit(&second, body));
        assert_eq!(again["status"], "done", "{again}");
        assert_eq!(
            job_png(&second, job, 0),
            job_png(&second, &again, 0),
            "{body}: the restarted job's image is the uninterrupted one's"
        );
    }
    assert!(second.terminate().success());
    // A third server still serves the finished images (until --keep-images).
    let third = start(&db);
    let job = get(&third.url(&format!("/kiln/v1/jobs/{}", ids[1])));
    assert_eq!(job["status"], "done", "{job}");
    let mut bytes = Vec::new();
    let url = third.url(job["images"][0]["url"].as_str().unwrap());
    std::io::Read::read_to_end(&mut agent().get(&url).call().unwrap().into_reader(), &mut bytes).unwrap();
    assert_eq!(decode_png(&bytes), job_png(&third, &jobs[1], 0));
    assert!(third.terminate().success());
    let _ = std::fs::remove_dir_all(&dir);
    took
}

#[test]
fn sigterm_finishes_the_running_job_and_the_next_server_runs_the_queued_ones() {
    let took = restart_with("durable-term", |first| {
        let stderr = first.stderr.clone();
        let status = first.terminate();
        assert!(status.success(), "{}", stderr.lock().unwrap());
        assert!(stderr.lock().unwrap().contains("shutting down"));
    });
    eprintln!("after SIGTERM the second server ended the jobs in {took:.1} s");
}

#[test]
fn sigkill_loses_no_accepted_job_the_running_one_runs_again() {
    let took = restart_with("durable-kill", |mut first| {
        first.child.kill().unwrap();
        first.child.wait().unwrap();
    });
    eprintln!("after SIGKILL the second server ended the jobs in {took:.1} s");
}
