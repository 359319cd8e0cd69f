//! The coordination service and its clients over loopback: the key-value store as XLA's peers
//! expect it, barriers, rendezvous, failure propagation, and the store as PJRT callbacks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_distributed::{
    ClientOptions, Code, CoordinationClient, CoordinationServer, PjrtStore, ServiceConfig, TaskView,
};
use kiln_pjrt::kv_store::as_plugin;

fn service(tasks: usize) -> CoordinationServer {
    CoordinationServer::start("127.0.0.1:0".parse().unwrap(), ServiceConfig::new(tasks)).unwrap()
}

fn options() -> ClientOptions {
    ClientOptions {
        connect_timeout: Duration::from_secs(10),
        heartbeat_interval: Duration::from_millis(100),
        exit_on_job_failure: false,
    }
}

fn join(server: &CoordinationServer, rank: usize) -> CoordinationClient {
    CoordinationClient::connect(&server.address().to_string(), rank, options()).unwrap()
}

#[test]
fn values_are_bytes_and_a_second_put_is_already_exists() {
    let server = service(2);
    let a = join(&server, 0);
    let b = join(&server, 1);
    let binary = b"topology\0proto\xff\x00end".to_vec();
    a.put("cuda:local_topology/0", &binary).unwrap();
    assert_eq!(b.get("cuda:local_topology/0", Duration::from_secs(1)).unwrap(), binary);
    let again = b.put("cuda:local_topology/0", b"other").unwrap_err();
    assert_eq!(again.code, Code::AlreadyExists, "{again}");
    assert_eq!(
        a.try_get("cuda:local_topology/0").unwrap().unwrap(),
        binary,
        "the first value stays"
    );
    b.put_overwrite("cuda:local_topology/0", b"other").unwrap();
    assert_eq!(
        a.try_get("/cuda:local_topology//0/").unwrap().unwrap(),
        b"other",
        "keys are normalized"
    );
    assert_eq!(a.try_get("missing").unwrap(), None);
    a.put("empty", b"").unwrap();
    assert_eq!(b.try_get("empty").unwrap(), Some(Vec::new()));
}

#[test]
fn get_waits_for_a_put_and_times_out_without_one() {
    let server = service(2);
    let a = join(&server, 0);
    let b = Arc::new(join(&server, 1));
    let writer = {
        let b = b.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            b.put("nccl_id/clique", b"id").unwrap();
        })
    };
    let started = Instant::now();
    assert_eq!(a.get("nccl_id/clique", Duration::from_secs(10)).unwrap(), b"id");
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "get returned before the put"
    );
    writer.join().unwrap();
    let started = Instant::now();
    let e = a.get("never", Duration::from_millis(300)).unwrap_err();
    assert_eq!(e.code, Code::DeadlineExceeded);
    assert!(e.message.contains("never"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn directories_list_and_delete_many_keys() {
    let server = service(1);
    let a = join(&server, 0);
    for i in 0..500 {
        a.put(&format!("dir/key{i:04}"), format!("value {i}").as_bytes())
            .unwrap();
    }
    a.put("dir2/other", b"x").unwrap();
    a.put("dir", b"the directory's own key").unwrap();
    let listed = a.get_dir("dir").unwrap();
    assert_eq!(listed.len(), 500);
    assert_eq!(listed[0], ("dir/key0000".to_string(), b"value 0".to_vec()));
    assert_eq!(listed[499].0, "dir/key0499");
    a.delete("dir/key0001", false).unwrap();
    assert_eq!(a.get_dir("dir").unwrap().len(), 499);
    a.delete("dir", true).unwrap();
    assert!(a.get_dir("dir").unwrap().is_empty());
    assert_eq!(a.try_get("dir").unwrap(), None);
    assert_eq!(a.try_get("dir2/other").unwrap().unwrap(), b"x");
}

#[test]
fn a_barrier_passes_when_all_arrive_and_names_who_did_not() {
    let server = Arc::new(service(3));
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let server = server.clone();
            std::thread::spawn(move || {
                let client = join(&server, rank);
                std::thread::sleep(Duration::from_millis(100 * rank as u64));
                client.barrier("step", Duration::from_secs(10))
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap().unwrap();
    }
    let a = join(&server, 0);
    let b = join(&server, 1);
    let late = std::thread::spawn(move || b.barrier("lonely", Duration::from_millis(400)));
    let e = a.barrier("lonely", Duration::from_millis(400)).unwrap_err();
    assert_eq!(e.code, Code::DeadlineExceeded);
    assert!(e.message.contains("rank 2 did not arrive"), "{e}");
    assert_eq!(late.join().unwrap().unwrap_err().code, Code::DeadlineExceeded);
}

#[test]
fn the_rendezvous_names_the_ranks_that_never_came() {
    let server = service(4);
    let a = join(&server, 0);
    let _b = join(&server, 2);
    let b = Arc::new(join(&server, 1));
    let late = {
        let b = b.clone();
        std::thread::spawn(move || b.wait_for_all(Duration::from_millis(800)))
    };
    std::thread::sleep(Duration::from_millis(200));
    let e = a.wait_for_all(Duration::from_millis(800)).unwrap_err();
    assert_eq!(e.code, Code::DeadlineExceeded);
    assert!(
        e.message.contains("rank 3 never joined the job, rank 2 did not arrive"),
        "{e}"
    );
    assert_eq!(
        late.join().unwrap().unwrap_err(),
        e,
        "every rank at the barrier gets the same answer"
    );
    let e = CoordinationClient::connect(&server.address().to_string(), 4, options()).unwrap_err();
    assert!(e.message.contains("rank 4 is not in this job of 4 processes"), "{e}");
}

#[test]
fn a_failed_rank_stops_the_others_waits_and_heartbeats() {
    let server = service(2);
    let a = join(&server, 0);
    let _b = join(&server, 1);
    let waiter = std::thread::spawn(move || {
        let answer = a.get("never/put", Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(400));
        (answer, a.job_failure())
    });
    std::thread::sleep(Duration::from_millis(200));
    server.report_failure(1, "its process was killed by signal 9");
    let (answer, seen_by_heartbeat) = waiter.join().unwrap();
    let e = answer.unwrap_err();
    assert!(
        e.message.contains("rank 1 failed: its process was killed by signal 9"),
        "{e}"
    );
    let seen = seen_by_heartbeat.expect("the heartbeat reports the job's failure");
    assert!(seen.message.contains("rank 1 failed"), "{seen}");
    assert_eq!(
        server.tasks()[1],
        TaskView::Failed("its process was killed by signal 9".into())
    );
}

#[test]
fn a_process_that_stops_heartbeating_is_marked_failed() {
    let mut config = ServiceConfig::new(2);
    config.heartbeat_timeout = Duration::from_millis(300);
    let server = CoordinationServer::start("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let _a = join(&server, 0);
    let silent = ClientOptions {
        heartbeat_interval: Duration::from_secs(3600),
        ..options()
    };
    let _b = CoordinationClient::connect(&server.address().to_string(), 1, silent).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.tasks()[1] == TaskView::Connected && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    match &server.tasks()[1] {
        TaskView::Failed(message) => assert!(message.contains("no heartbeat"), "{message}"),
        other => panic!("rank 1 should have failed, is {other:?}"),
    }
    assert_eq!(server.tasks()[0], TaskView::Connected);
}

#[test]
fn shutdown_marks_a_rank_done() {
    let server = service(1);
    let mut a = join(&server, 0);
    a.put("k", b"v").unwrap();
    a.shutdown().unwrap();
    assert_eq!(server.tasks(), vec![TaskView::Done]);
    assert_eq!(server.value("k").unwrap(), b"v");
}

#[test]
fn the_store_answers_a_plugins_callbacks_with_xla_codes() {
    let server = service(2);
    let a: Arc<dyn kiln_pjrt::KeyValueStore> = Arc::new(PjrtStore::new(Arc::new(join(&server, 0)), "cuda"));
    let b: Arc<dyn kiln_pjrt::KeyValueStore> = Arc::new(PjrtStore::new(Arc::new(join(&server, 1)), "cuda"));
    let id = b"\x00\x01nccl unique id\x00\xfe".to_vec();
    as_plugin::put(a.clone(), b"clique/0,1", &id).unwrap();
    assert_eq!(
        server.value("cuda:clique/0,1").unwrap(),
        id,
        "keys carry the platform prefix"
    );
    assert_eq!(as_plugin::get(b.clone(), b"clique/0,1", 1000).unwrap(), id);
    assert_eq!(as_plugin::try_get(b.clone(), b"clique/0,1").unwrap(), id);
    let (code, message) = as_plugin::try_get(b.clone(), b"absent").unwrap_err();
    assert_eq!(code, kiln_pjrt::KeyValueError::NOT_FOUND, "{message}");
    let (code, _) = as_plugin::put(b.clone(), b"clique/0,1", b"again").unwrap_err();
    assert_eq!(code, kiln_pjrt::KeyValueError::ALREADY_EXISTS);
    let (code, _) = as_plugin::get(a, b"absent", 200).unwrap_err();
    assert_eq!(code, kiln_pjrt::KeyValueError::DEADLINE_EXCEEDED);
}

/// The CPU plugin takes the three callbacks in its create arguments and the job's `process_id`, so
/// a job's process creates its client the same way on every platform. A build that knows
/// `process_id` (lammps-jax-pjrt-cpu 0.11.2; `.ci/run` runs this test on it too) numbers rank 1's
/// devices apart from rank 0's; xla-cpu-pjrt 0.0.1 ignores the option.
#[test]
fn a_cpu_client_is_created_with_the_jobs_callbacks_and_process_id() {
    let Ok(location) = kiln_pjrt::SearchPaths::from_environment().find(Some(kiln_pjrt::Platform::Cpu)) else {
        panic!("the CPU plugin must be installed (scripts/setup)");
    };
    let server = service(2);
    let plugin = kiln_pjrt::Plugin::load(&location.path).unwrap();
    // Never unloaded: the plugin's threads outlive its clients until the process exits.
    std::mem::forget(plugin.clone());
    let mut ids = Vec::new();
    for rank in 0..2 {
        let store: Arc<dyn kiln_pjrt::KeyValueStore> = Arc::new(PjrtStore::new(Arc::new(join(&server, rank)), "cpu"));
        let mut options = vec![("cpu_device_count".to_string(), kiln_pjrt::NamedValue::Int64(2))];
        options.extend(kiln_tensor::job_create_options(kiln_pjrt::Platform::Cpu, rank, 2, 0));
        let client = kiln_pjrt::Client::with_store(plugin.clone(), &options, Some(store)).unwrap();
        assert_eq!(
            client.devices().len(),
            2,
            "a CPU client sees only its own process's devices"
        );
        assert!(client.devices().iter().all(|d| d.is_addressable()));
        let process = client.process_index() as usize;
        if process == 0 {
            // rank 0, or a build that ignores `process_id`
            assert!(client.devices().iter().all(|d| d.process_index() == 0));
        } else {
            assert_eq!(process, rank, "the plugin's process index is the job's rank");
            assert!(
                client
                    .devices()
                    .iter()
                    .all(|d| d.process_index() == 1 && !ids.contains(&d.id())),
                "rank 1's devices must be numbered apart from rank 0's"
            );
        }
        ids.extend(client.devices().iter().map(|d| d.id()));
    }
}
