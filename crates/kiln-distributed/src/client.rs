//! A process's side of the coordination service: registration, heartbeats, the key-value store
//! and barriers, as blocking calls (kiln's pipelines are synchronous).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_pjrt::{KeyValueError, KeyValueStore};
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

use crate::proto::coordination_service_client::CoordinationServiceClient;
use crate::proto::*;
use crate::{Error, Result};

/// How a client joins a job.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// How long to keep trying to reach and register with the service (it may start after us).
    pub connect_timeout: Duration,
    pub heartbeat_interval: Duration,
    /// Exit the process when the service reports that the job failed (another process died): a
    /// process blocked in a collective would otherwise wait forever. Off in tests.
    pub exit_on_job_failure: bool,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            connect_timeout: Duration::from_secs(300),
            heartbeat_interval: Duration::from_secs(5),
            exit_on_job_failure: false,
        }
    }
}

/// One process's connection to the job's coordination service.
pub struct CoordinationClient {
    runtime: tokio::runtime::Runtime,
    rpc: CoordinationServiceClient<Channel>,
    rank: i32,
    /// This process and the service it registered with, sent with every request.
    incarnations: Incarnations,
    /// How often each barrier id was passed: the next use's `counter`.
    barrier_uses: Mutex<std::collections::HashMap<String, i64>>,
    address: String,
    /// The job's failure as the heartbeats last reported it.
    failure: Arc<Mutex<Option<Error>>>,
    heartbeats: Option<tokio::task::JoinHandle<()>>,
    shut_down: bool,
}

impl std::fmt::Debug for CoordinationClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinationClient")
            .field("address", &self.address)
            .field("rank", &self.rank)
            .finish()
    }
}

impl CoordinationClient {
    /// Registers as `rank` with the service at `address` (`host:port`), retrying while it is not
    /// up yet, and starts sending heartbeats.
    pub fn connect(address: &str, rank: usize, options: ClientOptions) -> Result<CoordinationClient> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kiln-coordination-client")
            .enable_all()
            .build()
            .map_err(|e| Error::io(format!("cannot start the coordination client's thread: {e}")))?;
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| Error::invalid(format!("coordinator address {address} cannot be used: {e}")))?
            .connect_timeout(Duration::from_secs(5));
        let channel = {
            let _entered = runtime.enter();
            endpoint.connect_lazy()
        };
        let rpc = CoordinationServiceClient::new(channel)
            .max_decoding_message_size(usize::MAX)
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip);
        let rank = i32::try_from(rank).map_err(|_| Error::invalid(format!("rank {rank} is too large")))?;
        let incarnation: u64 = rand::random();
        let deadline = Instant::now() + options.connect_timeout;
        let registered = runtime.block_on(async {
            loop {
                let request = RegisterTaskRequest {
                    incarnation,
                    source_task_id: rank,
                };
                match rpc.clone().register_task(request).await {
                    Ok(response) => return Ok(response.into_inner().service_incarnation),
                    Err(status) if status.code() == Code::Unavailable && Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(status) if status.code() == Code::Unavailable => {
                        return Err(Error::new(
                            Code::DeadlineExceeded,
                            format!(
                                "the coordination service at {address} did not answer within {} s: {}",
                                options.connect_timeout.as_secs(),
                                status.message()
                            ),
                        ))
                    }
                    Err(status) => return Err(Error::from(status)),
                }
            }
        });
        let incarnations = Incarnations {
            task_id: rank,
            task_incarnation: incarnation,
            service_incarnation: registered?,
        };
        let failure = Arc::new(Mutex::new(None));
        let heartbeats = runtime.spawn(send_heartbeats(
            rpc.clone(),
            incarnations,
            options.clone(),
            failure.clone(),
        ));
        Ok(CoordinationClient {
            runtime,
            rpc,
            rank,
            incarnations,
            barrier_uses: Mutex::new(Default::default()),
            address: address.to_string(),
            failure,
            heartbeats: Some(heartbeats),
            shut_down: false,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank as usize
    }

    fn who(&self) -> Option<Incarnations> {
        Some(self.incarnations)
    }

    /// The job's failure, if the service reported one.
    pub fn job_failure(&self) -> Option<Error> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn call<T>(
        &self,
        timeout: Option<Duration>,
        future: impl std::future::Future<Output = std::result::Result<T, tonic::Status>>,
    ) -> Result<T> {
        self.runtime.block_on(async {
            match timeout {
                Some(timeout) => match tokio::time::timeout(timeout, future).await {
                    Ok(answer) => answer.map_err(Error::from),
                    Err(_) => Err(Error::new(Code::DeadlineExceeded, "timed out")),
                },
                None => future.await.map_err(Error::from),
            }
        })
    }

    /// Waits until every process of the job has joined, at most `timeout` (a barrier every rank
    /// passes once; the error names the ranks that never came).
    pub fn wait_for_all(&self, timeout: Duration) -> Result<()> {
        self.barrier("kiln/rendezvous", timeout)
    }

    /// Puts `key`; ALREADY_EXISTS when some process put it before.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.insert(key, value, false)
    }

    /// Puts `key`, replacing any value.
    pub fn put_overwrite(&self, key: &str, value: &[u8]) -> Result<()> {
        self.insert(key, value, true)
    }

    fn insert(&self, key: &str, value: &[u8], allow_overwrite: bool) -> Result<()> {
        let request = InsertKeyValueRequest {
            incarnations: self.who(),
            kv: Some(KeyValueEntry {
                key: key.into(),
                value: value.to_vec(),
            }),
            allow_overwrite,
        };
        let mut rpc = self.rpc.clone();
        self.call(None, async move { rpc.insert_key_value(request).await })?;
        Ok(())
    }

    /// The value of `key`, waiting up to `timeout` for a process to put it (DEADLINE_EXCEEDED after).
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut rpc = self.rpc.clone();
        let request = GetKeyValueRequest {
            incarnations: self.who(),
            key: key.into(),
        };
        let response = self
            .call(Some(timeout), async move { rpc.get_key_value(request).await })
            .map_err(|e| match e.code {
                Code::DeadlineExceeded => Error::new(
                    Code::DeadlineExceeded,
                    format!("key {key} was not put within {} ms", timeout.as_millis()),
                ),
                _ => e,
            })?;
        Ok(response.into_inner().kv.map(|kv| kv.value).unwrap_or_default())
    }

    /// The value of `key` now, `None` when it is not there.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut rpc = self.rpc.clone();
        let request = TryGetKeyValueRequest {
            incarnations: self.who(),
            key: key.into(),
        };
        match self.call(None, async move { rpc.try_get_key_value(request).await }) {
            Ok(response) => Ok(Some(response.into_inner().kv.map(|kv| kv.value).unwrap_or_default())),
            Err(e) if e.code == Code::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every key under `directory` (`dir/...`), with its value, in key order.
    pub fn get_dir(&self, directory: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let mut rpc = self.rpc.clone();
        let request = GetKeyValueDirRequest {
            incarnations: self.who(),
            directory_key: directory.into(),
        };
        let response = self.call(None, async move { rpc.get_key_value_dir(request).await })?;
        Ok(response
            .into_inner()
            .kv
            .into_iter()
            .map(|kv| (kv.key, kv.value))
            .collect())
    }

    /// Deletes `key` (and everything under it when `directory`).
    pub fn delete(&self, key: &str, directory: bool) -> Result<()> {
        let mut rpc = self.rpc.clone();
        let request = DeleteKeyValueRequest {
            incarnations: self.who(),
            key: key.into(),
            is_directory: directory,
        };
        self.call(None, async move { rpc.delete_key_value(request).await })?;
        Ok(())
    }

    /// Waits until every process of the job reached barrier `id`, at most `timeout`.
    pub fn barrier(&self, id: &str, timeout: Duration) -> Result<()> {
        let mut rpc = self.rpc.clone();
        let counter = {
            let mut uses = self.barrier_uses.lock().unwrap_or_else(|e| e.into_inner());
            let next = uses.entry(id.to_string()).or_insert(0);
            *next += 1;
            *next - 1
        };
        let request = BarrierRequest {
            incarnations: self.who(),
            barrier_id: id.into(),
            barrier_timeout_in_ms: timeout.as_millis().min(i64::MAX as u128) as i64,
            task_ids: Vec::new(),
            source_task_id: self.rank,
            counter,
        };
        self.call(None, async move { rpc.barrier(request).await })?;
        Ok(())
    }

    /// Leaves the job (the service marks this process done) and stops the heartbeats.
    pub fn shutdown(&mut self) -> Result<()> {
        if self.shut_down {
            return Ok(());
        }
        self.shut_down = true;
        if let Some(heartbeats) = self.heartbeats.take() {
            heartbeats.abort();
        }
        let mut rpc = self.rpc.clone();
        let request = ShutdownTaskRequest {
            incarnations: self.who(),
            source_task_id: self.rank,
        };
        self.call(Some(Duration::from_secs(10)), async move {
            rpc.shutdown_task(request).await
        })?;
        Ok(())
    }
}

impl Drop for CoordinationClient {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::debug!("leaving the job: {e}");
        }
    }
}

async fn send_heartbeats(
    mut rpc: CoordinationServiceClient<Channel>,
    incarnations: Incarnations,
    options: ClientOptions,
    failure: Arc<Mutex<Option<Error>>>,
) {
    loop {
        tokio::time::sleep(options.heartbeat_interval).await;
        let request = HeartbeatRequest {
            incarnations: Some(incarnations),
            incarnation: incarnations.task_incarnation,
            source_task_id: incarnations.task_id,
        };
        let Err(status) = rpc.heartbeat(request).await else {
            continue;
        };
        let error = match status.code() {
            Code::Unavailable => Error::new(
                Code::Unavailable,
                format!("the coordination service is gone: {}", status.message()),
            ),
            _ => Error::from(status),
        };
        *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.clone());
        if options.exit_on_job_failure {
            eprintln!(
                "error: rank {}: the job stopped: {}",
                incarnations.task_id, error.message
            );
            std::process::exit(1);
        }
        return;
    }
}

/// The coordination store as a PJRT plugin's key-value callbacks, its keys prefixed with the
/// platform name as JAX does (`cuda:local_topology/...`).
pub struct PjrtStore {
    client: Arc<CoordinationClient>,
    prefix: String,
}

impl PjrtStore {
    pub fn new(client: Arc<CoordinationClient>, platform: &str) -> PjrtStore {
        PjrtStore {
            client,
            prefix: format!("{platform}:"),
        }
    }

    fn key(&self, key: &[u8]) -> String {
        // XLA's keys are text; a non-UTF-8 byte would not survive the proto's string field.
        format!("{}{}", self.prefix, String::from_utf8_lossy(key))
    }
}

fn store_error(e: Error) -> KeyValueError {
    KeyValueError::new(e.code as i32, e.message)
}

impl KeyValueStore for PjrtStore {
    fn get(&self, key: &[u8], timeout: Duration) -> std::result::Result<Vec<u8>, KeyValueError> {
        self.client.get(&self.key(key), timeout).map_err(store_error)
    }

    fn try_get(&self, key: &[u8]) -> std::result::Result<Vec<u8>, KeyValueError> {
        let key = self.key(key);
        match self.client.try_get(&key).map_err(store_error)? {
            Some(value) => Ok(value),
            None => Err(KeyValueError::new(
                KeyValueError::NOT_FOUND,
                format!("key {key} not found"),
            )),
        }
    }

    fn put(&self, key: &[u8], value: &[u8]) -> std::result::Result<(), KeyValueError> {
        self.client.put(&self.key(key), value).map_err(store_error)
    }
}
