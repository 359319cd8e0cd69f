//! The jobs kept across restarts (`--jobs-db`): one SQLite file (built in: no system library)
//! holding the jobs API's queue, the inputs of its queued jobs and every job's finished images
//! until they expire.
//!
//! What is written when:
//! - a job of the jobs API is written (`queued`, with its input images' bytes) before its `202`
//!   is sent: an accepted job is on disk;
//! - a job that starts is marked `running` and its `attempts` counted;
//! - a job that ends is written with its outcome (and its PNGs when done; a job of the
//!   synchronous routes is written only when done, for its `url` images); its inputs go;
//! - a job dropped from the server's finished jobs (`--keep-images` past, or too many kept) goes.
//!
//! The next server on the same file ([`Store::load`]) queues again what was `queued`, and what
//! was `running` when the last one was killed (once: a job that was running at two kills in a
//! row fails instead), and serves the finished jobs' images until they expire. One server at a
//! time holds the file (SQLite's exclusive lock, released by the system when a process dies).

use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use rusqlite::{params, Connection};

use crate::jobs::Status;

/// How many times a job may be found `running` by a starting server (its last server was killed
/// while running it) before it is failed instead of run again.
pub const MAX_ATTEMPTS: i64 = 2;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    durable INTEGER NOT NULL,
    model TEXT NOT NULL,
    request TEXT NOT NULL,
    created INTEGER NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error_code INTEGER,
    error TEXT,
    step INTEGER NOT NULL DEFAULT 0,
    seconds REAL,
    finished_ms INTEGER,
    expires_ms INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq);
CREATE TABLE IF NOT EXISTS images (
    job TEXT NOT NULL,
    k INTEGER NOT NULL,
    png BLOB NOT NULL,
    params TEXT NOT NULL,
    PRIMARY KEY (job, k)
);
CREATE TABLE IF NOT EXISTS inputs (
    job TEXT NOT NULL,
    k INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    PRIMARY KEY (job, k)
);
CREATE TABLE IF NOT EXISTS blobs (
    sha256 TEXT PRIMARY KEY,
    bytes BLOB NOT NULL
);
";

/// The status's name in the file (as the API shows it).
fn status_name(status: Status) -> &'static str {
    match status {
        Status::Queued => "queued",
        Status::Running => "running",
        Status::Done => "done",
        Status::Failed => "failed",
        Status::Cancelled => "cancelled",
    }
}

fn status_of(name: &str) -> Option<Status> {
    Some(match name {
        "queued" => Status::Queued,
        "running" => Status::Running,
        "done" => Status::Done,
        "failed" => Status::Failed,
        "cancelled" => Status::Cancelled,
        _ => return None,
    })
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A job as the file holds it.
pub(crate) struct StoredJob {
    pub id: String,
    pub durable: bool,
    pub model: String,
    pub request: String,
    pub created: i64,
    pub status: Status,
    pub attempts: i64,
    pub error: Option<(u16, String)>,
    pub step: usize,
    pub seconds: Option<f64>,
    pub finished_ms: Option<i64>,
    /// (PNG, parameters as JSON) per image, in order.
    pub images: Vec<(Vec<u8>, String)>,
    /// The input images' bytes, in order (the images, then the mask).
    pub inputs: Vec<Vec<u8>>,
}

/// What a job's end writes.
pub(crate) struct Ending<'a> {
    pub status: Status,
    pub error: Option<&'a (u16, String)>,
    pub step: usize,
    pub seconds: Option<f64>,
    /// (PNG, parameters as JSON) per image.
    pub images: Vec<(&'a [u8], String)>,
}

/// The open file.
pub(crate) struct Store {
    conn: Mutex<Connection>,
    keep: Duration,
    path: std::path::PathBuf,
}

impl Store {
    /// Opens (or makes) the file at `path` and takes it for this process; finished jobs are kept
    /// `keep`.
    pub fn open(path: &Path, keep: Duration) -> Result<Store> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("--jobs-db: cannot make {}", dir.display()))?;
        }
        let conn = Connection::open(path).with_context(|| format!("--jobs-db: cannot open {}", path.display()))?;
        let taken = (|| -> rusqlite::Result<()> {
            // One server at a time: the lock is taken by the first write and held until the
            // connection closes (or the process dies).
            conn.busy_timeout(Duration::from_millis(200))?;
            conn.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
            conn.pragma_update(None, "journal_mode", "WAL")?;
            // Durable against a killed process (a power cut may lose the last transactions).
            conn.pragma_update(None, "synchronous", "NORMAL")?;
            conn.execute_batch(SCHEMA)?;
            conn.execute_batch("BEGIN IMMEDIATE; COMMIT;")
        })();
        taken.map_err(|e| match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => anyhow::anyhow!(
                "--jobs-db {}: another kiln serve is using it (give each server its own --jobs-db)",
                path.display()
            ),
            _ => anyhow::anyhow!("--jobs-db {}: {e}", path.display()),
        })?;
        Ok(Store {
            conn: Mutex::new(conn),
            keep,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes an accepted job of the jobs API, queued, with its input images' bytes (by sha256).
    pub fn accept(
        &self,
        id: &str,
        model: &str,
        request: &str,
        created: i64,
        inputs: &[(String, Vec<u8>)],
    ) -> rusqlite::Result<()> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        tx.execute(
            "INSERT INTO jobs (id, durable, model, request, created, status) VALUES (?1, 1, ?2, ?3, ?4, 'queued')",
            params![id, model, request, created],
        )?;
        for (k, (sha256, bytes)) in inputs.iter().enumerate() {
            tx.execute(
                "INSERT OR IGNORE INTO blobs (sha256, bytes) VALUES (?1, ?2)",
                params![sha256, bytes],
            )?;
            tx.execute(
                "INSERT INTO inputs (job, k, sha256) VALUES (?1, ?2, ?3)",
                params![id, k as i64, sha256],
            )?;
        }
        tx.commit()
    }

    /// A job starts: `running`, one more attempt.
    pub fn start(&self, id: &str) -> rusqlite::Result<()> {
        self.lock().execute(
            "UPDATE jobs SET status = 'running', attempts = attempts + 1 WHERE id = ?1",
            params![id],
        )?;
        Ok(())
    }

    /// A job goes back to the queue (the server stopped it to shut down).
    pub fn requeue(&self, id: &str) -> rusqlite::Result<()> {
        self.lock().execute(
            "UPDATE jobs SET status = 'queued', step = 0, attempts = max(attempts - 1, 0) WHERE id = ?1",
            params![id],
        )?;
        Ok(())
    }

    /// A job ended. A job not written yet (of a synchronous route) is written whole when
    /// `insert` gives its (model, request, created).
    pub fn finish(&self, id: &str, ending: Ending<'_>, insert: Option<(&str, &str, i64)>) -> rusqlite::Result<()> {
        let finished = now_ms();
        let expires = finished.saturating_add(self.keep.as_millis().min(i64::MAX as u128) as i64);
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        if let Some((model, request, created)) = insert {
            tx.execute(
                "INSERT OR IGNORE INTO jobs (id, durable, model, request, created, status) VALUES (?1, 0, ?2, ?3, ?4, 'running')",
                params![id, model, request, created],
            )?;
        }
        tx.execute(
            "UPDATE jobs SET status = ?2, error_code = ?3, error = ?4, step = ?5, seconds = ?6, finished_ms = ?7, expires_ms = ?8 WHERE id = ?1",
            params![
                id,
                status_name(ending.status),
                ending.error.map(|e| e.0),
                ending.error.map(|e| e.1.as_str()),
                ending.step as i64,
                ending.seconds,
                finished,
                expires
            ],
        )?;
        for (k, (png, params_json)) in ending.images.iter().enumerate() {
            tx.execute(
                "INSERT OR REPLACE INTO images (job, k, png, params) VALUES (?1, ?2, ?3, ?4)",
                params![id, k as i64, png, params_json],
            )?;
        }
        tx.execute("DELETE FROM inputs WHERE job = ?1", params![id])?;
        tx.execute("DELETE FROM blobs WHERE sha256 NOT IN (SELECT sha256 FROM inputs)", [])?;
        tx.commit()
    }

    /// Removes jobs (dropped from the server's finished jobs).
    pub fn delete(&self, ids: &[String]) -> rusqlite::Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        for id in ids {
            tx.execute("DELETE FROM images WHERE job = ?1", params![id])?;
            tx.execute("DELETE FROM inputs WHERE job = ?1", params![id])?;
            tx.execute("DELETE FROM jobs WHERE id = ?1", params![id])?;
        }
        // And those expired meanwhile that the server no longer held.
        let now = now_ms();
        tx.execute(
            "DELETE FROM images WHERE job IN (SELECT id FROM jobs WHERE expires_ms < ?1)",
            params![now],
        )?;
        tx.execute("DELETE FROM jobs WHERE expires_ms < ?1", params![now])?;
        tx.execute("DELETE FROM blobs WHERE sha256 NOT IN (SELECT sha256 FROM inputs)", [])?;
        tx.commit()
    }

    /// A finished job not expired (one the server dropped from memory, having too many).
    pub fn finished(&self, id: &str) -> rusqlite::Result<Option<StoredJob>> {
        let now = now_ms();
        let conn = self.lock();
        let row = conn.query_row(
            "SELECT durable, model, request, created, status, attempts, error_code, error, step, seconds, finished_ms FROM jobs WHERE id = ?1 AND finished_ms IS NOT NULL AND expires_ms >= ?2",
            params![id, now],
            |r| {
                Ok((
                    r.get::<_, bool>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, String>(4)?,
                    r.get::<_, i64>(5)?,
                    r.get::<_, Option<i64>>(6)?,
                    r.get::<_, Option<String>>(7)?,
                    r.get::<_, i64>(8)?,
                    r.get::<_, Option<f64>>(9)?,
                    r.get::<_, Option<i64>>(10)?,
                ))
            },
        );
        let (durable, model, request, created, status, attempts, code, error, step, seconds, finished_ms) = match row {
            Ok(row) => row,
            Err(rusqlite::Error::QueryReturnedNoRows) => return Ok(None),
            Err(e) => return Err(e),
        };
        let images = conn
            .prepare("SELECT png, params FROM images WHERE job = ?1 ORDER BY k")?
            .query_map(params![id], |r| Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, String>(1)?)))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(Some(StoredJob {
            id: id.to_string(),
            durable,
            model,
            request,
            created,
            status: status_of(&status).unwrap_or(Status::Failed),
            attempts,
            error: error.map(|e| (code.and_then(|c| u16::try_from(c).ok()).unwrap_or(500), e)),
            step: usize::try_from(step).unwrap_or(0),
            seconds,
            finished_ms,
            images,
            inputs: Vec::new(),
        }))
    }

    /// Every job kept, in the order accepted, after removing the expired ones (and any job of a
    /// synchronous route that had not ended: its client is gone).
    pub fn load(&self) -> rusqlite::Result<Vec<StoredJob>> {
        let now = now_ms();
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        tx.execute(
            "DELETE FROM images WHERE job IN (SELECT id FROM jobs WHERE expires_ms < ?1 OR (durable = 0 AND finished_ms IS NULL))",
            params![now],
        )?;
        tx.execute(
            "DELETE FROM jobs WHERE expires_ms < ?1 OR (durable = 0 AND finished_ms IS NULL)",
            params![now],
        )?;
        tx.execute("DELETE FROM inputs WHERE job NOT IN (SELECT id FROM jobs)", [])?;
        tx.execute("DELETE FROM blobs WHERE sha256 NOT IN (SELECT sha256 FROM inputs)", [])?;
        let mut jobs = Vec::new();
        {
            let mut rows = tx.prepare(
                "SELECT id, durable, model, request, created, status, attempts, error_code, error, step, seconds, finished_ms FROM jobs ORDER BY seq",
            )?;
            let mut images = tx.prepare("SELECT png, params FROM images WHERE job = ?1 ORDER BY k")?;
            let mut inputs = tx.prepare(
                "SELECT blobs.bytes FROM inputs JOIN blobs ON blobs.sha256 = inputs.sha256 WHERE inputs.job = ?1 ORDER BY inputs.k",
            )?;
            let found = rows.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, bool>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, String>(5)?,
                    r.get::<_, i64>(6)?,
                    r.get::<_, Option<i64>>(7)?,
                    r.get::<_, Option<String>>(8)?,
                    r.get::<_, i64>(9)?,
                    r.get::<_, Option<f64>>(10)?,
                    r.get::<_, Option<i64>>(11)?,
                ))
            })?;
            for row in found {
                let (id, durable, model, request, created, status, attempts, code, error, step, seconds, finished_ms) =
                    row?;
                let status = status_of(&status).unwrap_or(Status::Failed);
                let images = images
                    .query_map(params![id], |r| Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, String>(1)?)))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                let inputs = inputs
                    .query_map(params![id], |r| r.get::<_, Vec<u8>>(0))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                let error = match (code, error) {
                    (Some(code), Some(error)) => Some((u16::try_from(code).unwrap_or(500), error)),
                    (None, Some(error)) => Some((500, error)),
                    _ => None,
                };
                jobs.push(StoredJob {
                    id,
                    durable,
                    model,
                    request,
                    created,
                    status,
                    attempts,
                    error,
                    step: usize::try_from(step).unwrap_or(0),
                    seconds,
                    finished_ms,
                    images,
                    inputs,
                });
            }
        }
        tx.commit()?;
        Ok(jobs)
    }

    /// The number of jobs with `status` (for tests).
    #[cfg(test)]
    pub fn count(&self, status: Status) -> i64 {
        self.lock()
            .query_row(
                "SELECT count(*) FROM jobs WHERE status = ?1",
                params![status_name(status)],
                |r| r.get(0),
            )
            .unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_is_kept_from_its_acceptance_to_its_expiry_and_one_server_holds_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.sqlite");
        let store = Store::open(&path, Duration::from_secs(60)).unwrap();
        let e = Store::open(&path, Duration::from_secs(60)).err().unwrap().to_string();
        assert!(e.contains("another kiln serve"), "{e}");
        store
            .accept("a", "m", "{}", 1, &[("s1".into(), vec![1, 2]), ("s2".into(), vec![3])])
            .unwrap();
        store.accept("b", "m", "{}", 2, &[("s1".into(), vec![1, 2])]).unwrap();
        store.start("a").unwrap();
        let ending = Ending {
            status: Status::Done,
            error: None,
            step: 3,
            seconds: Some(0.5),
            images: vec![(b"png".as_slice(), "{}".into())],
        };
        store.finish("a", ending, None).unwrap();
        assert_eq!(store.count(Status::Done), 1);
        drop(store);
        let store = Store::open(&path, Duration::from_secs(60)).unwrap();
        let jobs = store.load().unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!((jobs[0].id.as_str(), jobs[0].status), ("a", Status::Done));
        assert_eq!(jobs[0].images, vec![(b"png".to_vec(), "{}".to_string())]);
        assert!(jobs[0].inputs.is_empty(), "a finished job's inputs go");
        assert_eq!((jobs[1].id.as_str(), jobs[1].status), ("b", Status::Queued));
        assert_eq!(jobs[1].inputs, vec![vec![1, 2]]);
        store.delete(&["a".into()]).unwrap();
        assert_eq!(store.load().unwrap().len(), 1);
    }
}
