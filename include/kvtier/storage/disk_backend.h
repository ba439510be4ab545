// Local disk storage backend: one file per object, io_uring for the data,
// O_DIRECT where the filesystem allows it.
//
// Layout on disk:
//   <root>/<ns digest>-<layout fingerprint>/LOCK          flock: one process owns the directory
//   <root>/<ns digest>-<layout fingerprint>/<xx>/<key>.kvo objects, 256 shards by the key's first byte
//   <root>/<ns digest>-<layout fingerprint>/incoming/      new files of puts in progress
//   <root>/<ns digest>-<layout fingerprint>/free/          recycled files (see below)
//   <root>/<ns digest>-<layout fingerprint>/quarantine/    objects that failed verification
// With a tenant (StorageOptions::tenant) the namespace directory is <root>/<tenant>/<ns digest>-
// <layout fingerprint>/ instead: the tenant directory must be this user's and no wider than
// dir_mode (FailedPrecondition otherwise), and with a tenant secret only objects whose header tag
// verifies are indexed (the others are quarantined, StorageStats::auth_failures).
// A put writes header + payload into a new file in incoming/ (or a recycled
// file in free/), makes the data durable (Durability::kPowerLoss: fdatasync;
// with O_DIRECT on ext4/XFS the directory fsync below covers it, because the
// journal commit it forces flushes the device cache after the direct write
// completed), renames it over "<xx>/<key>.kvo" (an existing object is swapped
// out atomically with RENAME_EXCHANGE) and fsyncs the shard directory before
// it is acknowledged: no reader, and no restart after a crash, ever sees a
// partial object. At start the index is rebuilt by scanning the shards:
// incoming/ is emptied, every object's header is decoded and checked (key,
// namespace, layout, sizes, header checksum); bad ones go to quarantine.
// Every size field is bounded by the format's limits and by the file's size
// before it is used, so a crafted header is quarantined like a damaged one.
// Files are opened with O_NOFOLLOW | O_NONBLOCK and used only when fstat says
// they are regular files: a FIFO, device, directory or symlink under an
// object's name is quarantined (at the rebuild and on a get), never waited on.
// Payload checksums are verified on every get.
//
// Recycling: files of deleted, evicted and replaced objects go to free/ (at
// most max_free_files files, not counted in capacity_bytes) and later puts
// overwrite them in place. Creating a file costs ext4 an inode allocation that
// grows to about a millisecond once many files were deleted, plus new blocks;
// overwriting costs neither. A file that a get is still reading is unlinked
// instead of recycled.
//
// Capacity: when a put would exceed capacity_bytes (object file bytes incl.
// headers), least-recently-used objects (by put/get/exists; mtime order after a
// restart) are removed first; before them, quarantined files and object files
// that do not authenticate with the tenant secret (left in place at the
// rebuild, unserved, oldest first). A recycled file is cut to its new object's
// size. A put larger than the capacity fails with
// ResourceExhausted. Errors: ENOSPC/EFBIG/EDQUOT -> ResourceExhausted, from any
// call that writes, syncs, renames or creates a file or directory (inodes
// running out are ENOSPC, at create too); EIO or a short file on read ->
// DataLoss (object quarantined); other write errors -> Unavailable (nothing
// acknowledged).
//
// Threading: post() enqueues and wakes one I/O thread that owns the ring; all
// file work (open, rename, unlink, verification) happens on that thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kvtier/backend/storage_backend.h"

namespace kvtier::storage {

class DiskFaultInjector;  // disk_fault.h

enum class Durability : std::uint8_t {
  kProcessCrash,  // temp + rename: acknowledged objects survive kill -9 (not a power loss)
  kPowerLoss,     // + fdatasync of the object and fsync of its directory before the ack
};

enum class DirectIo : std::uint8_t {
  kAuto,  // O_DIRECT if the filesystem accepts it, else buffered I/O for the backend's life: a warning
          // and StorageStats::direct_io_fallback = 1 (the gauge kvtier_storage_direct_io_fallback)
  kOn,    // O_DIRECT or fail at creation (NotSupported; ResourceExhausted when the disk is too full to probe)
  kOff,   // buffered I/O
};

// The ring's largest depth (create() refuses more; the storage.disk.queue_depth knob too).
inline constexpr std::uint32_t kMaxDiskQueueDepth = 4096;

struct DiskBackendConfig {
  std::string root;                  // created if absent
  std::uint64_t capacity_bytes = 0;  // 0 = unlimited
  Durability durability = Durability::kPowerLoss;
  DirectIo direct_io = DirectIo::kAuto;
  std::uint32_t queue_depth = 64;       // items in flight on the ring
  bool verify_payload_on_open = false;  // also verify every payload checksum while rebuilding the index
  std::uint32_t max_free_files = 1024;  // recycled-file pool (disk use beyond capacity_bytes: up to this many files)
  // Files kept in quarantine/ for an operator to inspect (oldest removed first); they count in
  // capacity_bytes and are removed before any object is evicted.
  std::uint32_t max_quarantine_files = 64;
  // Permissions of the files and directories the backend creates (the process umask still
  // applies): owner only by default, so other local users cannot read or plant blocks. Shared
  // access between the processes of one deployment: a common group and 0640 / 0750. The owner needs read and
  // write on files (0600) and everything on directories (0700): create() refuses less.
  std::uint32_t file_mode = 0600;
  std::uint32_t dir_mode = 0700;
  // Tests only (disk_fault.h): sees every I/O completion first and may turn it into an error or a
  // short transfer. Null, the default, costs one pointer test per completion.
  std::shared_ptr<DiskFaultInjector> fault_injector;
};

// Creates the backend, takes the directory lock and rebuilds the index
// (blocking: reads every object header). FailedPrecondition when another
// process holds the directory; also, naming the path, when the root is owned
// by another user (not root) or is writable by group or others without the
// sticky bit, or when any directory below it (tenant, namespace, incoming/,
// quarantine/, free/, a shard) is a symlink or owned by another user: below
// the root every file and directory is reached through directory fds
// (openat/renameat/unlinkat, O_NOFOLLOW), never by path (docs/storage.md).
Result<std::unique_ptr<StorageBackend>> create_disk_backend(DiskBackendConfig config, StorageOptions options);

}  // namespace kvtier::storage
