// The disk backend's index: which objects are stored, their sizes and LRU
// order, guarded by index_mu_. Rebuilt at start by scanning the shard
// directories (every object's header checked, bad files quarantined,
// uncommitted puts removed, the free/ pool taken over); kept within
// capacity_bytes by evicting least-recently-used objects. Files of evicted,
// deleted and replaced objects go to the pool of free files that later puts
// overwrite, or are unlinked (the pool is full, or a get may still read them).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <mutex>
#include <vector>

#include "storage/disk/disk_backend_impl.h"
#include "storage/object_format.h"

namespace kvtier::storage::disk {

namespace {

Result<StorageKey> parse_key_name(std::string_view name) {
  // "<32 hex>-r<rank>.kvo"
  if (name.size() < 32 + 2 + 1 + 4 || name.substr(name.size() - 4) != kObjectSuffix || name[32] != '-' ||
      name[33] != 'r')
    return InvalidArgument(fmt::format("not an object file name: {}", name));
  StorageKey k;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (int i = 0; i < 16; ++i) {
    int a = hex(name[2 * i]), b = hex(name[2 * i + 1]);
    if (a < 0 || b < 0) return InvalidArgument(fmt::format("bad hex in object file name: {}", name));
    k.digest[i] = static_cast<std::uint8_t>(a * 16 + b);
  }
  std::string_view rank = name.substr(34, name.size() - 34 - 4);
  if (rank.empty() || rank.size() > 10) return InvalidArgument(fmt::format("bad rank in {}", name));
  std::uint64_t r = 0;
  for (char c : rank) {
    if (c < '0' || c > '9') return InvalidArgument(fmt::format("bad rank in {}", name));
    r = r * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (r > UINT32_MAX) return InvalidArgument(fmt::format("bad rank in {}", name));
  k.rank = static_cast<std::uint32_t>(r);
  return k;
}

}  // namespace

// ---- index --------------------------------------------------------------

void DiskBackend::quarantine_locked(const StorageKey& key, const Status& status) {
  const std::string dst = fmt::format("{}.{}.{}", key.to_string(), ::getpid(), ++seq_);
  const std::string name = object_name(key);
  const std::string path = final_path(key);
  const int sd = shard_fd(key);
  struct stat sb {};
  const std::uint64_t bytes = ::fstatat(sd, name.c_str(), &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(sb.st_mode)
                                  ? static_cast<std::uint64_t>(sb.st_size)
                                  : 0;
  if (config_.max_quarantine_files > 0 && ::renameat(sd, name.c_str(), quarantine_fd_.get(), dst.c_str()) == 0) {
    quarantine_files_.emplace_back(dst, bytes);
    quarantine_bytes_ += bytes;
    trim_quarantine_locked(config_.max_quarantine_files);
  } else {
    ::unlinkat(sd, name.c_str(), 0);
  }
  ++quarantined_;
  if (format::is_auth_failure(status)) ++auth_failures_;
  log_line(fmt::format("quarantined {}: {}", path, status.to_string()));
  auto it = index_.find(key);
  if (it != index_.end()) erase_locked(it);
}

void DiskBackend::erase_locked(std::unordered_map<StorageKey, IndexEntry, StorageKeyHash>::iterator it) {
  used_bytes_ -= it->second.file_bytes;
  lru_.erase(it->second.lru);
  index_.erase(it);
}

void DiskBackend::insert_locked(const StorageKey& key, std::uint64_t file_bytes, std::uint32_t header_size,
                                std::uint64_t payload_bytes) {
  auto it = index_.find(key);
  if (it != index_.end()) erase_locked(it);
  lru_.push_back(key);
  index_.emplace(key, IndexEntry{file_bytes, header_size, payload_bytes, std::prev(lru_.end())});
  used_bytes_ += file_bytes;
}

// Removes the oldest quarantined files until at most `keep` remain.
void DiskBackend::trim_quarantine_locked(std::size_t keep) {
  while (quarantine_files_.size() > keep) {
    ::unlinkat(quarantine_fd_.get(), quarantine_files_.front().first.c_str(), 0);
    quarantine_bytes_ -= quarantine_files_.front().second;
    quarantine_files_.pop_front();
  }
}

bool DiskBackend::forget_unauthenticated_locked(const StorageKey& key) {
  auto it = unauthenticated_.find(key);
  if (it == unauthenticated_.end()) return false;
  unauthenticated_bytes_ -= it->second;
  unauthenticated_.erase(it);
  return true;
}

// Takes over the files an earlier run left in quarantine/ (oldest first), within the bound.
void DiskBackend::adopt_quarantine_locked() {
  auto names = list_dir(quarantine_fd_.get(), dir_ + "/quarantine");
  if (!names.ok()) return;
  std::vector<std::pair<std::int64_t, std::pair<std::string, std::uint64_t>>> files;
  for (std::string& n : *names) {
    struct stat sb {};
    if (::fstatat(quarantine_fd_.get(), n.c_str(), &sb, AT_SYMLINK_NOFOLLOW) != 0) continue;
    const std::uint64_t bytes = S_ISREG(sb.st_mode) ? static_cast<std::uint64_t>(sb.st_size) : 0;
    files.push_back(
        {static_cast<std::int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec, {std::move(n), bytes}});
  }
  std::sort(files.begin(), files.end());
  for (auto& [mtime, f] : files) {
    quarantine_bytes_ += f.second;
    quarantine_files_.push_back(std::move(f));
  }
  trim_quarantine_locked(config_.max_quarantine_files);
}

// Deletes quarantined files, then LRU objects, until `incoming` more bytes fit. Objects being
// read stay readable (open fds). An object whose file cannot be removed stays indexed (it would be served
// again after a restart, and its bytes still take the disk): the eviction stops there with that error.
Status DiskBackend::make_room_locked(std::uint64_t incoming, const StorageKey* keep) {
  if (config_.capacity_bytes == 0) return Status::Ok();
  while (!quarantine_files_.empty() &&
         used_bytes_ + quarantine_bytes_ + unauthenticated_bytes_ + reserved_bytes_ + incoming > config_.capacity_bytes)
    trim_quarantine_locked(quarantine_files_.size() - 1);
  while (!unauthenticated_order_.empty() &&
         used_bytes_ + quarantine_bytes_ + unauthenticated_bytes_ + reserved_bytes_ + incoming >
             config_.capacity_bytes) {
    const StorageKey key = unauthenticated_order_.front();
    unauthenticated_order_.pop_front();
    if (forget_unauthenticated_locked(key)) ::unlinkat(shard_fd(key), object_name(key).c_str(), 0);
  }
  while (!lru_.empty() && !(keep != nullptr && lru_.front() == *keep) &&
         used_bytes_ + quarantine_bytes_ + unauthenticated_bytes_ + reserved_bytes_ + incoming >
             config_.capacity_bytes) {
    const StorageKey victim = lru_.front();
    auto it = index_.find(victim);
    KVTIER_RETURN_IF_ERROR(recycle_or_unlink_locked(shard_fd(victim), object_name(victim), it->second.file_bytes,
                                                    victim, final_path(victim))
                               .with_context(fmt::format("evicting {} to make room", victim.to_string())));
    erase_locked(it);
    ++evictions_;
  }
  return Status::Ok();
}

// Files of deleted, evicted and replaced objects go to a small pool of free files that later puts
// overwrite in place: creating a file costs ext4 an inode allocation (about a millisecond once many
// files were deleted) and new blocks, overwriting costs neither. A file that a get may still be
// reading is unlinked instead, so no reader ever sees its inode rewritten.
Status DiskBackend::recycle_or_unlink_locked(int dirfd, const std::string& name, std::uint64_t bytes,
                                             const StorageKey& key, std::string_view shown) {
  auto r = reading_.find(key);
  if (free_files_.size() < max_free_files_ && (r == reading_.end() || r->second == 0)) {
    // Never over a free file already there: names repeat across instances (a reopened tier, a restarted container
    // with the same pid), and a replaced name listed twice handed one inode to two puts at once (an acknowledged
    // put lost, or another key's bytes served under it). Taken names are skipped.
    for (int attempt = 0; attempt < 8; ++attempt) {
      std::string dst = fmt::format("{}.{}", ::getpid(), ++seq_);
      if (::renameat2(dirfd, name.c_str(), free_fd_.get(), dst.c_str(), RENAME_NOREPLACE) == 0) {
        free_files_.emplace_back(std::move(dst), bytes);
        return Status::Ok();
      }
      if (errno != EEXIST) break;  // the file system cannot refuse to replace (EINVAL), or the file is gone
    }
  }
  if (::unlinkat(dirfd, name.c_str(), 0) != 0 && errno != ENOENT)
    return fs_error(errno, fmt::format("unlink {}", shown));
  return Status::Ok();
}

Status DiskBackend::rebuild_index() {
  struct Found {
    StorageKey key;
    std::uint64_t file_bytes;
    std::uint32_t header_size;
    std::uint64_t payload_bytes;
    std::int64_t mtime_ns;
  };
  std::vector<Found> found, not_ours;
  // Objects whose MAC does not verify with this tenant's secret. They are neither indexed (never served) nor
  // quarantined: a misconfigured secret (another file, a rotated one, none) fails every object, and quarantining them
  // lost the store to a typo (the quarantine keeps a few for inspection). Left in place, they come back once the
  // secret is right; a put of the same key replaces one.
  std::uint64_t unauthenticated = 0;
  std::string first_unauthenticated;
  AlignedBuf buf = alloc_aligned(kAlign);
  std::lock_guard<std::mutex> lk(index_mu_);
  adopt_quarantine_locked();
  const mode_t dmode = static_cast<mode_t>(config_.dir_mode);
  for (std::uint32_t s = 0; s < kNumShards; ++s) {
    const std::string sd = shard_dir(s);
    // A shard directory that is a link, or another user's, is refused like the others: the
    // rebuild below removes and moves files in it.
    auto shard = open_owned_dir(dir_fd_.get(), shard_name(s), sd, dmode, false, false);
    if (shard.status().code() == StatusCode::kNotFound) continue;
    KVTIER_RETURN_IF_ERROR(shard.status());
    shard_fds_[s] = std::move(shard).value();
    const int sfd = shard_fds_[s].get();
    KVTIER_ASSIGN_OR_RETURN(std::vector<std::string> names, list_dir(sfd, sd));
    for (const std::string& n : names) {
      const std::string path = sd + "/" + n;
      if (n.find(kTmpMarker) != std::string::npos) {
        ::unlinkat(sfd, n.c_str(), 0);  // a put that never committed
        ++removed_tmp_;
        continue;
      }
      auto key = parse_key_name(n);
      if (!key.ok() || key->digest[0] != s) {
        log_line(fmt::format("ignoring unexpected file {}", path));
        continue;
      }
      Status st = check_object_file(sfd, n, path, *key, buf);
      if (!st.ok() && format::is_auth_failure(st)) {
        if (unauthenticated++ == 0) first_unauthenticated = fmt::format("{}: {}", path, st.message());
        ++auth_failures_;
        struct stat sb {};
        if (::fstatat(sfd, n.c_str(), &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(sb.st_mode))
          not_ours.push_back({*key, static_cast<std::uint64_t>(sb.st_size), 0, 0,
                              static_cast<std::int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec});
        continue;
      }
      if (!st.ok()) {
        quarantine_locked(*key, st);
        continue;
      }
      found.push_back({*key, last_file_bytes_, last_header_size_, last_payload_bytes_, last_mtime_ns_});
    }
  }
  if (unauthenticated > 0)
    log_line(
        fmt::format("{} of {} objects do not authenticate with this backend's tenant secret ({}): left in "
                    "place and not served, counted against the capacity and removed first when room is needed (a "
                    "misconfigured storage.tenant.secret_file?); the first: {}",
                    unauthenticated, unauthenticated + found.size(),
                    options_.tenant_secret.empty() ? "none configured" : "the one configured", first_unauthenticated));
  KVTIER_ASSIGN_OR_RETURN(std::vector<std::string> incoming, list_dir(incoming_fd_.get(), dir_ + "/incoming"));
  for (const std::string& n : incoming) {
    ::unlinkat(incoming_fd_.get(), n.c_str(), 0);  // puts that never committed
    ++removed_tmp_;
  }
  KVTIER_ASSIGN_OR_RETURN(std::vector<std::string> free_names, list_dir(free_fd_.get(), dir_ + "/free"));
  for (std::string& n : free_names) {
    struct stat sb {};
    // Only a plain file of ours with no other name is ever overwritten by a later put: a hard
    // link would carry the object's bytes to wherever its other name is.
    if (free_files_.size() < max_free_files_ && ::fstatat(free_fd_.get(), n.c_str(), &sb, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(sb.st_mode) && sb.st_nlink == 1 && sb.st_uid == ::geteuid())
      free_files_.emplace_back(std::move(n), static_cast<std::uint64_t>(sb.st_size));
    else
      ::unlinkat(free_fd_.get(), n.c_str(), 0);
  }
  const auto older = [](const Found& a, const Found& b) { return a.mtime_ns < b.mtime_ns; };
  std::sort(found.begin(), found.end(), older);
  for (const Found& f : found) insert_locked(f.key, f.file_bytes, f.header_size, f.payload_bytes);
  std::sort(not_ours.begin(), not_ours.end(), older);
  for (const Found& f : not_ours) {
    unauthenticated_.emplace(f.key, f.file_bytes);
    unauthenticated_order_.push_back(f.key);
    unauthenticated_bytes_ += f.file_bytes;
  }
  if (Status s = make_room_locked(0); !s.ok()) log_line(s.to_string());
  if (removed_tmp_ > 0)
    log_line(fmt::format("removed {} uncommitted temporary files in {}", removed_tmp_, dir_), LogLevel::kInfo);
  return Status::Ok();
}

// Reads and checks the header of one object file (and the payload when configured).
Status DiskBackend::check_object_file(int dirfd, const std::string& name, const std::string& shown,
                                      const StorageKey& key, AlignedBuf& buf) {
  struct stat sb {};
  auto opened = open_regular(dirfd, name, shown, O_RDONLY, &sb);
  if (!opened.ok()) return DataLoss(opened.status().message());
  ScopedFd fd = std::move(opened).value();
  std::uint64_t want = std::min<std::uint64_t>(kAlign, static_cast<std::uint64_t>(sb.st_size));
  std::vector<std::byte> big;
  std::byte* hdr = buf.get();
  ssize_t n = ::pread(fd.get(), hdr, want, 0);
  if (n < 0) return DataLoss(fmt::format("pread: {}", errno_text(errno)));
  std::uint32_t needed = 0;
  const std::string_view secret = options_.tenant_secret;
  auto h = format::decode_header(hdr, static_cast<std::size_t>(n), &needed, secret);
  if (!h.ok() && h.status().code() == StatusCode::kOutOfRange && needed <= sb.st_size) {
    big.resize(needed);
    if (::pread(fd.get(), big.data(), needed, 0) != static_cast<ssize_t>(needed)) return DataLoss("short header read");
    hdr = big.data();
    h = format::decode_header(hdr, needed, nullptr, secret);
  }
  if (!h.ok()) return h.status().code() == StatusCode::kOutOfRange ? DataLoss(h.status().message()) : h.status();
  KVTIER_RETURN_IF_ERROR(format::check_identity(*h, ns_digest_, options_.layout_fingerprint, key));
  KVTIER_RETURN_IF_ERROR(format::check_object_size(*h, static_cast<std::uint64_t>(sb.st_size), false));
  // A put writes the header and the payload (aligned up for O_DIRECT) and cuts a recycled file to that: a longer
  // file holds bytes no put wrote, and indexed it would be charged its whole size (one such file emptied a tier).
  const std::uint64_t most = h->header_size + align_up(h->payload_bytes, kAlign);
  if (static_cast<std::uint64_t>(sb.st_size) > most)
    return DataLoss(fmt::format("file of {} bytes, more than its object's header {} + payload {} take ({})",
                                static_cast<std::uint64_t>(sb.st_size), h->header_size, h->payload_bytes, most));
  if (config_.verify_payload_on_open) {
    // Through a fixed buffer: the payload may be far larger than what memory allows at once.
    constexpr std::uint64_t kChunk = std::uint64_t{1} << 20;
    AlignedBuf chunk = alloc_aligned(kChunk);
    if (!chunk) return ResourceExhausted("out of memory for the payload check");
    std::vector<std::byte> hcopy(hdr, hdr + h->header_size);
    format::ObjectVerifier v(hcopy.data(), *h, secret);
    for (std::uint64_t off = 0; off < h->payload_bytes;) {
      const std::uint64_t len = std::min(kChunk, h->payload_bytes - off);
      const ssize_t r = ::pread(fd.get(), chunk.get(), len, static_cast<off_t>(h->header_size + off));
      if (r <= 0)
        return DataLoss(fmt::format("payload read at {}: {}", off, r < 0 ? errno_text(errno) : "end of file"));
      v.update(chunk.get(), static_cast<std::size_t>(r));
      off += static_cast<std::uint64_t>(r);
    }
    KVTIER_RETURN_IF_ERROR(v.finish());
  }
  last_file_bytes_ = static_cast<std::uint64_t>(sb.st_size);
  last_mtime_ns_ = static_cast<std::int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec;
  last_header_size_ = h->header_size;
  last_payload_bytes_ = h->payload_bytes;
  return Status::Ok();
}

}  // namespace kvtier::storage::disk
