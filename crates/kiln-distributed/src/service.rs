//! The coordination service: the rendezvous and key-value store of one job, served over gRPC
//! by one process (the launcher of node 0) and spoken to by every process of the job.
//!
//! Semantics follow XLA's service where a peer can observe them: a key put twice without
//! `allow_overwrite` is ALREADY_EXISTS, `TryGetKeyValue` of a missing key is NOT_FOUND,
//! `GetKeyValue` blocks until the key exists, a barrier passes when every participant arrived and
//! fails for all with DEADLINE_EXCEEDED naming the absent ones, and a task in error makes every
//! wait of the others fail with its message.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tonic::{Code, Request, Response, Status};

use crate::proto::coordination_service_server::{CoordinationService, CoordinationServiceServer};
use crate::proto::*;
use crate::{ranks_list, Error, Result};

/// How a service is configured.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Processes in the job (task ids `0..num_tasks`).
    pub num_tasks: usize,
    /// A registered task that sends no heartbeat for this long is marked failed.
    pub heartbeat_timeout: Duration,
}

impl ServiceConfig {
    pub fn new(num_tasks: usize) -> ServiceConfig {
        ServiceConfig {
            num_tasks,
            heartbeat_timeout: Duration::from_secs(60),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum TaskStatus {
    Absent,
    Connected { incarnation: u64 },
    Disconnected,
    Failed(String),
}

#[derive(Debug)]
struct Task {
    status: TaskStatus,
    last_heartbeat: Instant,
}

#[derive(Debug)]
struct Barrier {
    participants: BTreeSet<usize>,
    arrived: BTreeSet<usize>,
    deadline: Instant,
    outcome: Option<Status>,
}

#[derive(Debug)]
struct State {
    tasks: Vec<Task>,
    /// Bumped on every change of a task's status (`WatchTasks` long-polls on it).
    version: i64,
    values: BTreeMap<String, Vec<u8>>,
    /// By barrier id and use (`counter`).
    barriers: HashMap<(String, i64), Barrier>,
    /// The first failure of the job: the task and its message.
    failure: Option<(usize, String)>,
    stopping: bool,
}

struct Shared {
    config: ServiceConfig,
    leader_incarnation: u64,
    state: Mutex<State>,
    /// Woken on every change of `state`; waiters re-check their condition.
    changed: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update<T>(&self, change: impl FnOnce(&mut State) -> T) -> T {
        let out = change(&mut self.lock());
        self.changed.notify_waiters();
        out
    }

    /// Polls `check` after every change until it answers.
    async fn wait_for<T>(
        &self,
        check: impl FnMut(&mut State) -> Option<std::result::Result<T, Status>>,
    ) -> std::result::Result<T, Status> {
        self.wait_until(None, check, |_| unreachable!("no deadline to pass"))
            .await
    }

    /// Polls `check` after every change until it answers, or `deadline` passes (`on_timeout`).
    async fn wait_until<T>(
        &self,
        deadline: Option<Instant>,
        mut check: impl FnMut(&mut State) -> Option<std::result::Result<T, Status>>,
        on_timeout: impl FnOnce(&mut State) -> Status,
    ) -> std::result::Result<T, Status> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(answer) = check(&mut self.lock()) {
                return answer;
            }
            match deadline {
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline.into(), notified).await.is_err() {
                        let status = on_timeout(&mut self.lock());
                        self.changed.notify_waiters();
                        return Err(status);
                    }
                }
                None => notified.await,
            }
        }
    }
}

impl State {
    fn task_id(&self, id: i32) -> std::result::Result<usize, Status> {
        usize::try_from(id)
            .ok()
            .filter(|&id| id < self.tasks.len())
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "rank {id} is not in this job of {} processes (ranks 0 to {})",
                    self.tasks.len(),
                    self.tasks.len().saturating_sub(1)
                ))
            })
    }

    fn set_status(&mut self, rank: usize, status: TaskStatus) {
        self.tasks[rank].status = status;
        self.version += 1;
    }

    /// The job's failure as the status every waiting task gets.
    fn failure_status(&self) -> Option<Status> {
        self.failure
            .as_ref()
            .map(|(rank, message)| Status::internal(format!("rank {rank} failed: {message}")))
    }

    fn fail(&mut self, rank: usize, message: String) {
        if rank < self.tasks.len() {
            self.set_status(rank, TaskStatus::Failed(message.clone()));
        }
        if self.failure.is_none() {
            self.failure = Some((rank, message));
        }
    }

    fn task_info(&self, rank: usize) -> TaskInfo {
        let (state, incarnation, message) = match &self.tasks[rank].status {
            TaskStatus::Absent => (TaskState::Uninitialized, 0, String::new()),
            TaskStatus::Connected { incarnation } => (TaskState::Connected, *incarnation, String::new()),
            TaskStatus::Disconnected => (TaskState::Disconnected, 0, String::new()),
            TaskStatus::Failed(message) => (TaskState::Error, 0, message.clone()),
        };
        let failed = state == TaskState::Error;
        TaskInfo {
            task_id: rank as i32,
            incarnation,
            state: state as i32,
            error_code: if failed { Code::Internal as i32 } else { 0 },
            error_message: message,
            error_payload: None,
        }
    }
}

/// Keys as XLA stores them: no repeated, leading or trailing slashes.
fn normalize_key(key: &str) -> String {
    key.split('/')
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join("/")
}

#[derive(Clone)]
struct Service(Arc<Shared>);

type Answer<T> = std::result::Result<Response<T>, Status>;

impl Service {
    /// Refuses a request meant for an earlier incarnation of this service (it restarted, and the
    /// job's state with it).
    fn check(&self, incarnations: &Option<Incarnations>) -> std::result::Result<(), Status> {
        match incarnations {
            Some(i) if i.service_incarnation != 0 && i.service_incarnation != self.0.leader_incarnation => {
                Err(Status::failed_precondition(format!(
                    "rank {} talks to an earlier coordination service; this one restarted and knows no job state",
                    i.task_id
                )))
            }
            _ => Ok(()),
        }
    }

    async fn wait_for_key(&self, key: &str) -> std::result::Result<Vec<u8>, Status> {
        self.0
            .wait_for(|state| {
                if let Some(value) = state.values.get(key) {
                    return Some(Ok(value.clone()));
                }
                if state.stopping {
                    return Some(Err(Status::aborted("the coordination service is shutting down")));
                }
                state.failure_status().map(Err)
            })
            .await
    }
}

#[tonic::async_trait]
impl CoordinationService for Service {
    async fn register_task(&self, request: Request<RegisterTaskRequest>) -> Answer<RegisterTaskResponse> {
        let request = request.into_inner();
        self.0.update(|state| {
            let rank = state.task_id(request.source_task_id)?;
            match &state.tasks[rank].status {
                TaskStatus::Connected { incarnation } if *incarnation != request.incarnation => {
                    let message = format!("rank {rank} registered again as a new process (it restarted)");
                    state.fail(rank, message.clone());
                    return Err(Status::aborted(message));
                }
                TaskStatus::Failed(message) => {
                    return Err(Status::aborted(format!("rank {rank} failed before: {message}")));
                }
                _ => {}
            }
            state.set_status(
                rank,
                TaskStatus::Connected {
                    incarnation: request.incarnation,
                },
            );
            state.tasks[rank].last_heartbeat = Instant::now();
            Ok(())
        })?;
        Ok(Response::new(RegisterTaskResponse {
            service_incarnation: self.0.leader_incarnation,
        }))
    }

    async fn heartbeat(&self, request: Request<HeartbeatRequest>) -> Answer<HeartbeatResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let mut state = self.0.lock();
        let rank = state.task_id(request.source_task_id)?;
        if let Some(status) = state.failure_status() {
            return Err(status);
        }
        let task = &mut state.tasks[rank];
        match task.status {
            TaskStatus::Connected { incarnation } if incarnation == request.incarnation => {
                task.last_heartbeat = Instant::now();
            }
            _ => return Err(Status::aborted(format!("rank {rank} is not registered with the job"))),
        }
        Ok(Response::new(HeartbeatResponse {
            service_incarnation: self.0.leader_incarnation,
        }))
    }

    async fn shutdown_task(&self, request: Request<ShutdownTaskRequest>) -> Answer<ShutdownTaskResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        self.0.update(|state| {
            let rank = state.task_id(request.source_task_id)?;
            if let TaskStatus::Connected { .. } = state.tasks[rank].status {
                state.set_status(rank, TaskStatus::Disconnected);
            }
            Ok::<_, Status>(())
        })?;
        Ok(Response::new(ShutdownTaskResponse {}))
    }

    async fn watch_tasks(&self, request: Request<WatchTasksRequest>) -> Answer<WatchTasksResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let seen = request.version_number;
        let response = self
            .0
            .wait_for(|state| {
                if state.stopping {
                    return Some(Err(Status::aborted("the coordination service is shutting down")));
                }
                (state.version != seen).then(|| {
                    Ok(WatchTasksResponse {
                        task_state: (0..state.tasks.len()).map(|rank| state.task_info(rank)).collect(),
                        version_number: state.version,
                    })
                })
            })
            .await?;
        Ok(Response::new(response))
    }

    async fn insert_key_value(&self, request: Request<InsertKeyValueRequest>) -> Answer<InsertKeyValueResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let entry = request
            .kv
            .ok_or_else(|| Status::invalid_argument("InsertKeyValue without a key-value entry"))?;
        let key = normalize_key(&entry.key);
        self.0.update(|state| {
            if !request.allow_overwrite && state.values.contains_key(&key) {
                return Err(Status::already_exists(format!("key {key} already exists")));
            }
            state.values.insert(key, entry.value);
            Ok(())
        })?;
        Ok(Response::new(InsertKeyValueResponse {}))
    }

    async fn get_key_value(&self, request: Request<GetKeyValueRequest>) -> Answer<GetKeyValueResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let key = normalize_key(&request.key);
        let value = self.wait_for_key(&key).await?;
        Ok(Response::new(GetKeyValueResponse {
            kv: Some(KeyValueEntry { key, value }),
        }))
    }

    async fn try_get_key_value(&self, request: Request<TryGetKeyValueRequest>) -> Answer<TryGetKeyValueResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let key = normalize_key(&request.key);
        let value = self.0.lock().values.get(&key).cloned();
        match value {
            Some(value) => Ok(Response::new(TryGetKeyValueResponse {
                kv: Some(KeyValueEntry { key, value }),
            })),
            None => Err(Status::not_found(format!("key {key} not found"))),
        }
    }

    async fn increment_key_value(
        &self,
        request: Request<IncrementKeyValueRequest>,
    ) -> Answer<IncrementKeyValueResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let key = normalize_key(&request.key);
        let value = self.0.update(|state| {
            let current = match state.values.get(&key) {
                None => 0,
                Some(bytes) => std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|text| text.parse::<i64>().ok())
                    .ok_or_else(|| Status::invalid_argument(format!("key {key} does not hold a counter")))?,
            };
            let next = current.wrapping_add(request.increment).to_string().into_bytes();
            state.values.insert(key.clone(), next.clone());
            Ok::<_, Status>(next)
        })?;
        Ok(Response::new(IncrementKeyValueResponse {
            kv: Some(KeyValueEntry { key, value }),
        }))
    }

    async fn get_key_value_dir(&self, request: Request<GetKeyValueDirRequest>) -> Answer<GetKeyValueDirResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let directory_key = normalize_key(&request.directory_key);
        let prefix = format!("{directory_key}/");
        let kv = self
            .0
            .lock()
            .values
            .range(prefix.clone()..)
            .take_while(|(key, _)| key.starts_with(&prefix))
            .map(|(key, value)| KeyValueEntry {
                key: key.clone(),
                value: value.clone(),
            })
            .collect();
        Ok(Response::new(GetKeyValueDirResponse { directory_key, kv }))
    }

    async fn delete_key_value(&self, request: Request<DeleteKeyValueRequest>) -> Answer<DeleteKeyValueResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let key = normalize_key(&request.key);
        self.0.update(|state| {
            state.values.remove(&key);
            if request.is_directory {
                let prefix = format!("{key}/");
                state.values.retain(|k, _| !k.starts_with(&prefix));
            }
        });
        Ok(Response::new(DeleteKeyValueResponse {}))
    }

    async fn barrier(&self, request: Request<BarrierRequest>) -> Answer<BarrierResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let id = request.barrier_id.clone();
        let key = (id.clone(), request.counter);
        let timeout = Duration::from_millis(request.barrier_timeout_in_ms.max(0) as u64);
        let deadline = self.0.update(|state| {
            let rank = state.task_id(request.source_task_id)?;
            let participants: BTreeSet<usize> = if request.task_ids.is_empty() {
                (0..state.tasks.len()).collect()
            } else {
                request
                    .task_ids
                    .iter()
                    .map(|&t| state.task_id(t))
                    .collect::<std::result::Result<_, _>>()?
            };
            if !participants.contains(&rank) {
                return Err(Status::invalid_argument(format!(
                    "rank {rank} waits at barrier {id} but is not one of its tasks"
                )));
            }
            let barrier = state.barriers.entry(key.clone()).or_insert_with(|| Barrier {
                participants: participants.clone(),
                arrived: BTreeSet::new(),
                deadline: Instant::now() + timeout,
                outcome: None,
            });
            if barrier.participants != participants {
                let status = Status::invalid_argument(format!(
                    "barrier {id} was called with different sets of tasks ({} and {})",
                    ranks_list(&barrier.participants.iter().copied().collect::<Vec<_>>()),
                    ranks_list(&participants.iter().copied().collect::<Vec<_>>())
                ));
                barrier.outcome.get_or_insert(status.clone());
                return Err(status);
            }
            barrier.arrived.insert(rank);
            Ok(barrier.deadline)
        })?;
        let outcome = |state: &mut State| -> Option<std::result::Result<(), Status>> {
            let failure = state.failure.clone();
            let barrier = state.barriers.get_mut(&key)?;
            if barrier.outcome.is_none() {
                if barrier.arrived == barrier.participants {
                    barrier.outcome = Some(Status::ok(""));
                } else if let Some((rank, message)) = failure.filter(|(rank, _)| barrier.participants.contains(rank)) {
                    barrier.outcome = Some(Status::internal(format!("rank {rank} failed: {message}")));
                }
            }
            barrier
                .outcome
                .clone()
                .map(|status| if status.code() == Code::Ok { Ok(()) } else { Err(status) })
        };
        self.0
            .wait_until(Some(deadline), outcome, |state| {
                let never_joined: BTreeSet<usize> = (0..state.tasks.len())
                    .filter(|&i| state.tasks[i].status == TaskStatus::Absent)
                    .collect();
                let Some(barrier) = state.barriers.get_mut(&key) else {
                    return Status::internal(format!("barrier {id} vanished"));
                };
                let missing: Vec<usize> = barrier.participants.difference(&barrier.arrived).copied().collect();
                let (absent, late): (Vec<usize>, Vec<usize>) = missing.iter().partition(|r| never_joined.contains(r));
                let mut why = Vec::new();
                if !absent.is_empty() {
                    why.push(format!("{} never joined the job", ranks_list(&absent)));
                }
                if !late.is_empty() {
                    why.push(format!("{} did not arrive", ranks_list(&late)));
                }
                let status = match &barrier.outcome {
                    Some(status) if status.code() != Code::Ok => status.clone(),
                    Some(_) => return Status::ok(""),
                    None => Status::deadline_exceeded(format!(
                        "barrier {id} timed out after {} s: {}",
                        timeout.as_secs_f64(),
                        why.join(", ")
                    )),
                };
                barrier.outcome = Some(status.clone());
                status
            })
            .await
            .or_else(|status| if status.code() == Code::Ok { Ok(()) } else { Err(status) })?;
        Ok(Response::new(BarrierResponse {
            counter: request.counter,
        }))
    }

    async fn cancel_barrier(&self, request: Request<CancelBarrierRequest>) -> Answer<CancelBarrierResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let id = request.barrier_id;
        let key = (id.clone(), request.counter);
        self.0.update(|state| {
            let rank = state.task_id(request.source_task_id)?;
            let barrier = state
                .barriers
                .get_mut(&key)
                .ok_or_else(|| Status::not_found(format!("barrier {id} does not exist")))?;
            match &barrier.outcome {
                Some(status) if status.code() == Code::Ok => {
                    Err(Status::failed_precondition(format!("barrier {id} has already passed")))
                }
                _ => {
                    barrier.outcome = Some(Status::cancelled(format!("barrier {id} was cancelled by rank {rank}")));
                    Ok(())
                }
            }
        })?;
        Ok(Response::new(CancelBarrierResponse {}))
    }

    /// The listed tasks that are connected now, with their incarnations.
    async fn get_alive_tasks(&self, request: Request<GetAliveTasksRequest>) -> Answer<GetAliveTasksResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        let state = self.0.lock();
        let mut response = GetAliveTasksResponse::default();
        for &id in &request.task_ids {
            let rank = state.task_id(id)?;
            if let TaskStatus::Connected { incarnation } = state.tasks[rank].status {
                response.alive_task_ids.push(id);
                response.incarnations.push(incarnation);
            }
        }
        Ok(Response::new(response))
    }

    async fn poll_for_error(&self, request: Request<PollForErrorRequest>) -> Answer<PollForErrorResponse> {
        let request = request.into_inner();
        self.check(&request.incarnations)?;
        self.0.lock().task_id(request.source_task_id)?;
        let never: std::result::Result<(), Status> = self
            .0
            .wait_for(|state| {
                if state.stopping {
                    return Some(Err(Status::aborted("the coordination service is shutting down")));
                }
                state.failure_status().map(Err)
            })
            .await;
        never.map(|()| Response::new(PollForErrorResponse {}))
    }
}

/// What a task looks like from the service: for the launcher's messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskView {
    /// Not registered yet.
    Absent,
    Connected,
    /// Shut down after it was connected.
    Done,
    Failed(String),
}

/// A running coordination service. Dropping it stops the service.
pub struct CoordinationServer {
    shared: Arc<Shared>,
    address: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl CoordinationServer {
    /// Serves a job of `config.num_tasks` processes on `address` (port 0: a free port, see
    /// [`CoordinationServer::address`]).
    pub fn start(address: SocketAddr, config: ServiceConfig) -> Result<CoordinationServer> {
        if config.num_tasks == 0 {
            return Err(Error::invalid("a job needs at least one process"));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kiln-coordinator")
            .enable_all()
            .build()
            .map_err(|e| Error::io(format!("cannot start the coordination service's threads: {e}")))?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(address))
            .map_err(|e| Error::io(format!("cannot listen on {address} for the coordination service: {e}")))?;
        let address = listener
            .local_addr()
            .map_err(|e| Error::io(format!("the coordination service's address: {e}")))?;
        let shared = Arc::new(Shared {
            leader_incarnation: rand::random(),
            state: Mutex::new(State {
                version: 0,
                tasks: (0..config.num_tasks)
                    .map(|_| Task {
                        status: TaskStatus::Absent,
                        last_heartbeat: Instant::now(),
                    })
                    .collect(),
                values: BTreeMap::new(),
                barriers: HashMap::new(),
                failure: None,
                stopping: false,
            }),
            changed: Notify::new(),
            config,
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // XLA's clients gzip their requests.
        let service = CoordinationServiceServer::new(Service(shared.clone()))
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip)
            .send_compressed(tonic::codec::CompressionEncoding::Gzip);
        runtime.spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let served = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = served {
                tracing::error!("the coordination service stopped: {e}");
            }
        });
        runtime.spawn(watch_heartbeats(shared.clone()));
        Ok(CoordinationServer {
            shared,
            address,
            stop: Some(stop),
            runtime: Some(runtime),
        })
    }

    /// The address clients connect to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Each task's state, by rank.
    pub fn tasks(&self) -> Vec<TaskView> {
        self.shared
            .lock()
            .tasks
            .iter()
            .map(|task| match &task.status {
                TaskStatus::Absent => TaskView::Absent,
                TaskStatus::Connected { .. } => TaskView::Connected,
                TaskStatus::Disconnected => TaskView::Done,
                TaskStatus::Failed(message) => TaskView::Failed(message.clone()),
            })
            .collect()
    }

    /// Marks `rank` failed with `message` (the launcher saw its process die): every other
    /// process waiting on the job gets an error naming it.
    pub fn report_failure(&self, rank: usize, message: impl Into<String>) {
        let message = message.into();
        self.shared.update(|state| state.fail(rank, message));
    }

    /// The value of `key`, if a task put it.
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.lock().values.get(&normalize_key(key)).cloned()
    }
}

impl Drop for CoordinationServer {
    fn drop(&mut self) {
        self.shared.update(|state| state.stopping = true);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Marks a connected task failed when its heartbeats stop (its process or host is gone).
async fn watch_heartbeats(shared: Arc<Shared>) {
    let timeout = shared.config.heartbeat_timeout;
    let period = (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        tokio::time::sleep(period).await;
        let stale: Vec<usize> = {
            let state = shared.lock();
            if state.stopping {
                return;
            }
            (0..state.tasks.len())
                .filter(|&i| {
                    matches!(state.tasks[i].status, TaskStatus::Connected { .. })
                        && state.tasks[i].last_heartbeat.elapsed() > timeout
                })
                .collect()
        };
        if !stale.is_empty() {
            shared.update(|state| {
                for rank in stale {
                    state.fail(
                        rank,
                        format!(
                            "sent no heartbeat for {} s: its process or host is gone",
                            timeout.as_secs()
                        ),
                    );
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::normalize_key;

    #[test]
    fn keys_lose_repeated_leading_and_trailing_slashes() {
        assert_eq!(normalize_key("/a//b/c/"), "a/b/c");
        assert_eq!(normalize_key("cuda:local_topology/0"), "cuda:local_topology/0");
    }
}
