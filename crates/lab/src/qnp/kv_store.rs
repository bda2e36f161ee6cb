//! The key-value store behind the example GET service: RocksDB, as in the paper's evaluation
//! (§5.3), through the `rocksdb` crate linked to the system librocksdb (Debian's
//! `librocksdb-dev`; `ROCKSDB_LIB_DIR` in the workspace's `.cargo/config.toml`).
//!
//! The store is shared by all workers: RocksDB's reads are thread-safe and lock-free on the
//! read path (memtable and block-cache lookups), so the workers stay shared-nothing in our code.

use crate::qnp::load::kv_key;
use crate::LabError;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A RocksDB database of keys and values.
pub struct KvStore {
    // Declared before `_dir` so that the database closes before its directory is removed.
    db: rocksdb::DB,
    path: PathBuf,
    _dir: Option<RemoveOnDrop>,
}

/// Removes a temporary database directory.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The value pre-loaded for key number `n`: 64 bytes.
pub fn preload_value(n: usize) -> Vec<u8> {
    format!("{n:064}").into_bytes()
}

impl KvStore {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<KvStore, LabError> {
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        let db = rocksdb::DB::open(&opts, path).map_err(|e| store_err(path, e))?;
        Ok(KvStore {
            db,
            path: path.to_path_buf(),
            _dir: None,
        })
    }

    /// Opens a fresh database in a new directory under the system's temporary directory; the
    /// directory is removed when the store is dropped.
    pub fn temporary() -> Result<KvStore, LabError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "flatmesh-qnp-kv-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        // A directory left by an earlier process with the same pid is stale.
        let _ = std::fs::remove_dir_all(&dir);
        let guard = RemoveOnDrop(dir.clone());
        let mut store = KvStore::open(&dir)?;
        store._dir = Some(guard);
        Ok(store)
    }

    /// Writes keys `kv_key(0..keys)` (62 bytes) with [`preload_value`]s (64 bytes) in batches
    /// of 65,536 and flushes them to SST files, so that GETs read through RocksDB's block cache
    /// as a loaded store's would. The paper pre-loads 3.14 million keys.
    pub fn preload(&self, keys: usize) -> Result<(), LabError> {
        const BATCH: usize = 65_536;
        for start in (0..keys).step_by(BATCH) {
            let mut batch = rocksdb::WriteBatch::default();
            for n in start..(start + BATCH).min(keys) {
                batch.put(kv_key(n, keys), preload_value(n));
            }
            self.db.write(batch).map_err(|e| store_err(&self.path, e))?;
        }
        self.db.flush().map_err(|e| store_err(&self.path, e))
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, LabError> {
        self.db
            .get_pinned(key)
            .map(|v| v.map(|v| v.to_vec()))
            .map_err(|e| store_err(&self.path, e))
    }

    /// Stores `value` under `key`.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<(), LabError> {
        self.db
            .put(key, value)
            .map_err(|e| store_err(&self.path, e))
    }

    /// Where the database lives.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn store_err(path: &Path, e: rocksdb::Error) -> LabError {
    LabError::Store {
        path: path.to_path_buf(),
        msg: e.into_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preloaded_keys_read_back_and_the_directory_goes_away() {
        let store = KvStore::temporary().unwrap();
        let dir = store.path().to_path_buf();
        store.preload(240).unwrap();
        assert_eq!(
            store.get(kv_key(17, 240).as_bytes()).unwrap(),
            Some(preload_value(17))
        );
        assert_eq!(store.get(b"nope").unwrap(), None);
        store.put(b"k", b"v").unwrap();
        assert_eq!(store.get(b"k").unwrap(), Some(b"v".to_vec()));
        drop(store);
        assert!(!dir.exists(), "the temporary database is removed");
    }

    #[test]
    fn a_database_locked_by_another_store_gets_a_clear_error() {
        let store = KvStore::temporary().unwrap();
        let e = KvStore::open(store.path()).err().unwrap().to_string();
        assert!(e.contains("RocksDB"), "{e}");
        assert!(e.contains("another process"), "{e}");
    }
}
