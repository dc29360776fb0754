// Checkpoints on bad storage, with real processes: a --checkpoint_dir that
// cannot be written, or that a live server of the same shard holds, ends the
// server at start (exit 2); a full disk (a small
// tmpfs) gets a bounded number of tries and log lines, leaves no temporary
// file, recovers as soon as there is room, and is visible in Stats and on
// /metrics; a directory removed mid-job is recreated. The mount tests need
// root (or CAP_SYS_ADMIN) and skip, saying so, where mounts are refused.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/http_util.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

using testing::BinaryPath;
using testing::ClusterOptions;
using testing::HttpGet;
using testing::MetricValue;
using testing::Process;
using testing::TestCluster;
using testing::TestDir;

// A job that runs until it is killed: a small model, so a checkpoint is a
// few KB and the tmpfs below holds a few of them.
std::vector<std::string> EndlessWorkerFlags() {
  return {"--model=mlp",     "--hidden=16",           "--num_features=12",
          "--num_classes=3", "--train_examples=4096", "--test_examples=256",
          "--batch_size=16", "--block_elements=64",   "--log_every=0",
          "--device=cpu",    "--retry_window_s=60",   "--steps=100000000"};
}

// A mount that is undone (lazily, so a process still inside cannot keep it)
// and whose mount point is removed when this goes away, also when the test
// fails part way.
class ScopedMount {
 public:
  // A tmpfs of `bytes` at `target` (created).
  static absl::StatusOr<std::unique_ptr<ScopedMount>> Tmpfs(
      const std::string& target, int64_t bytes) {
    std::filesystem::create_directories(target);
    auto mount = std::unique_ptr<ScopedMount>(new ScopedMount(target));
    if (::mount("tmpfs", target.c_str(), "tmpfs", 0,
                absl::StrCat("size=", bytes).c_str()) != 0) {
      mount->mounted_ = false;
      return absl::ErrnoToStatus(errno, absl::StrCat("mount tmpfs ", target));
    }
    return mount;
  }

  // `source` bind-mounted read-only at `target` (created).
  static absl::StatusOr<std::unique_ptr<ScopedMount>> ReadOnlyBind(
      const std::string& source, const std::string& target) {
    std::filesystem::create_directories(target);
    auto mount = std::unique_ptr<ScopedMount>(new ScopedMount(target));
    if (::mount(source.c_str(), target.c_str(), nullptr, MS_BIND, nullptr) !=
        0) {
      mount->mounted_ = false;
      return absl::ErrnoToStatus(errno, absl::StrCat("bind mount ", target));
    }
    if (::mount(nullptr, target.c_str(), nullptr,
                MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("remount ro ", target));
    }
    return mount;
  }

  ~ScopedMount() {
    if (mounted_ && ::umount2(target_.c_str(), MNT_DETACH) != 0) {
      ADD_FAILURE() << "cannot unmount " << target_ << ": "
                    << std::strerror(errno);
      return;  // never remove what may still be the mounted filesystem
    }
    std::error_code ignored;
    std::filesystem::remove_all(target_, ignored);
  }

 private:
  explicit ScopedMount(std::string target) : target_(std::move(target)) {}
  std::string target_;
  bool mounted_ = true;
};

// Remounts `target` with `flags` (MS_REMOUNT added). A read-only remount
// is refused (EBUSY) while a file there is open for writing, as a
// checkpoint being written is for a few milliseconds: tried again, bounded.
absl::Status Remount(const std::string& target, unsigned long flags) {
  for (int attempt = 0; attempt < 500; ++attempt) {
    if (::mount(nullptr, target.c_str(), nullptr, MS_REMOUNT | flags,
                nullptr) == 0) {
      return absl::OkStatus();
    }
    if (errno != EBUSY) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return absl::ErrnoToStatus(errno, absl::StrCat("remount ", target));
}

// Fills the filesystem holding `dir` with `path` until it refuses more.
void FillDisk(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const std::string chunk(4096, 'x');
  while (::write(fd, chunk.data(), chunk.size()) > 0) {
  }
  EXPECT_EQ(errno, ENOSPC) << std::strerror(errno);
  ::close(fd);
}

std::vector<std::string> ListDir(const std::string& path) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(path, error)) {
    names.push_back(entry.path().filename().string());
  }
  return names;
}

int CountLines(const std::string& text, const std::string& needle) {
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    n += absl::StrContains(line, needle) ? 1 : 0;
  }
  return n;
}

// Starts one ps_server with `flags` and returns its exit code and stderr;
// the server must end by itself within 30 s.
std::pair<int, std::string> RunServerExpectingExit(
    const std::string& dir, const std::string& name,
    const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {BinaryPath("ps_server/ps_server"),
                                   "--host=127.0.0.1",
                                   "--port=0",
                                   "--shard_id=0",
                                   "--num_shards=1",
                                   "--num_workers=1"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  absl::StatusOr<std::unique_ptr<Process>> server =
      Process::Start(argv, dir, name);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return {-1, ""};
  absl::StatusOr<int> code = (*server)->Wait(absl::Seconds(30));
  EXPECT_TRUE(code.ok()) << "the server did not exit: " << code.status();
  return {code.value_or(-1), (*server)->Stderr()};
}

TEST(CheckpointStorageTest, DirectoryThatCannotBeCreatedExitsAtStart) {
  const std::string dir = TestDir() + "/not_a_dir";
  std::filesystem::create_directories(dir);
  const std::string file = dir + "/plain_file";
  std::ofstream(file) << "x";
  const std::string checkpoint_dir = file + "/checkpoints";
  auto [code, stderr_text] =
      RunServerExpectingExit(dir, "ps", {"--checkpoint_dir=" + checkpoint_dir});
  EXPECT_EQ(code, 2) << stderr_text;
  EXPECT_EQ(CountLines(stderr_text, "--checkpoint_dir=" + checkpoint_dir), 1)
      << stderr_text;
  EXPECT_TRUE(absl::StrContains(stderr_text, "Not a directory")) << stderr_text;
}

TEST(CheckpointStorageTest, ReadOnlyDirectoryExitsAtStart) {
  const std::string dir = TestDir() + "/read_only";
  std::filesystem::create_directories(dir + "/source");
  absl::StatusOr<std::unique_ptr<ScopedMount>> mount =
      ScopedMount::ReadOnlyBind(dir + "/source", dir + "/ro");
  if (!mount.ok()) {
    GTEST_SKIP() << "this machine does not allow a read-only bind mount ("
                 << mount.status() << "); run as root to test it";
  }
  // The directory itself on a read-only filesystem, and a missing one whose
  // parent is read-only (it cannot be created).
  for (const std::string& checkpoint_dir : {dir + "/ro", dir + "/ro/new"}) {
    auto [code, stderr_text] = RunServerExpectingExit(
        dir, "ps", {"--checkpoint_dir=" + checkpoint_dir});
    EXPECT_EQ(code, 2) << stderr_text;
    EXPECT_EQ(CountLines(stderr_text, "--checkpoint_dir=" + checkpoint_dir), 1)
        << stderr_text;
    EXPECT_TRUE(absl::StrContains(stderr_text, "Read-only file system"))
        << stderr_text;
  }
}

// Two jobs pointed at one directory would interleave their files, and the
// next restore would take the other job's newest: a server whose shard's
// checkpoints a live process holds waits --checkpoint_dir_wait_s for it
// (the shard's previous server may be writing its last checkpoint), then
// exits 2 naming the holder. A killed holder holds nothing.
TEST(CheckpointStorageTest, ALiveServersCheckpointDirectoryIsNotShared) {
  const std::string dir = TestDir() + "/shared";
  const std::string checkpoint_dir = dir + "/checkpoints";
  std::filesystem::create_directories(dir);
  ClusterOptions options;
  options.server_flags = {"--checkpoint_dir=" + checkpoint_dir};
  absl::StatusOr<std::unique_ptr<TestCluster>> started =
      TestCluster::Start(options, "first_job");
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& cluster = **started;

  auto [code, stderr_text] = RunServerExpectingExit(
      dir, "second_job",
      {"--checkpoint_dir=" + checkpoint_dir, "--checkpoint_dir_wait_s=0.3"});
  EXPECT_EQ(code, 2) << stderr_text;
  EXPECT_EQ(CountLines(stderr_text, "--checkpoint_dir=" + checkpoint_dir), 1)
      << stderr_text;
  EXPECT_TRUE(absl::StrContains(stderr_text,
                                absl::StrCat("held by another ps_server (pid ",
                                             cluster.server(0).pid(), " on ")))
      << stderr_text;

  // kill -9: the restart takes the shard's checkpoints at once.
  cluster.KillServer(0);
  ASSERT_TRUE(cluster.RestartServer(0, {"--checkpoint_dir_wait_s=0"}).ok());

  // A server that waits gets them once the holder has stopped (SIGTERM).
  const std::string port_file = dir + "/waiting.port";
  absl::StatusOr<std::unique_ptr<Process>> waiting = Process::Start(
      {BinaryPath("ps_server/ps_server"), "--host=127.0.0.1", "--port=0",
       "--shard_id=0", "--num_shards=1", "--num_workers=1",
       "--port_file=" + port_file, "--checkpoint_dir=" + checkpoint_dir,
       "--checkpoint_dir_wait_s=60"},
      dir, "waiting");
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains((*waiting)->Stderr(), "waiting up to") &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(absl::StrContains((*waiting)->Stderr(), "waiting up to"))
      << (*waiting)->Stderr();
  EXPECT_FALSE(std::filesystem::exists(port_file));
  ASSERT_TRUE(cluster.StopServer(0).ok());
  while (!std::filesystem::exists(port_file) && (*waiting)->running() &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(std::filesystem::exists(port_file)) << (*waiting)->Stderr();
  (*waiting)->Signal(SIGTERM);
  absl::StatusOr<int> ended = (*waiting)->Wait(absl::Seconds(30));
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(*ended, 0) << (*waiting)->Stderr();
}

TEST(CheckpointStorageTest, FullDiskBacksOffAndRecoversWhenThereIsRoom) {
  const std::string dir = TestDir() + "/full_disk";
  const std::string mount_point = dir + "/disk";
  absl::StatusOr<std::unique_ptr<ScopedMount>> mount =
      ScopedMount::Tmpfs(mount_point, 1 << 20);
  if (!mount.ok()) {
    GTEST_SKIP() << "this machine does not allow a tmpfs mount ("
                 << mount.status() << "); run as root to test it";
  }
  const std::string filler = mount_point + "/filler";
  FillDisk(filler);
  const std::string checkpoint_dir = mount_point + "/checkpoints";
  const std::string metrics_port_file = dir + "/metrics.port";

  ClusterOptions options;
  options.server_flags = {"--checkpoint_dir=" + checkpoint_dir,
                          "--checkpoint_every_s=2", "--metrics_port=-1",
                          "--metrics_port_file=" + metrics_port_file};
  absl::StatusOr<std::unique_ptr<TestCluster>> started =
      TestCluster::Start(options, "full_disk");
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& cluster = **started;
  absl::StatusOr<std::unique_ptr<Process>> worker =
      cluster.StartWorker(0, 1, EndlessWorkerFlags());
  ASSERT_TRUE(worker.ok()) << worker.status();

  // 10 s of a full disk, as the server's own monotonic clock counts it.
  ASSERT_TRUE(cluster
                  .WaitForStats(
                      [](const StatsResponse& s) {
                        return s.checkpoint().failing_s() >= 10;
                      },
                      absl::Seconds(40))
                  .ok());
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const CheckpointStats& failing = (*stats)[0].checkpoint();
  EXPECT_TRUE(failing.enabled());
  EXPECT_EQ(failing.written(), 0);
  // Tries 1 s, 2 s, 4 s, 8 s apart: 4 or 5 in 10 s (the old 2 ms poll made
  // thousands).
  EXPECT_GE(failing.failing_tries(), 3);
  EXPECT_LE(failing.failing_tries(), 6);
  EXPECT_EQ(failing.failures().at("no_space"), failing.failing_tries());
  EXPECT_TRUE(absl::StrContains(failing.last_error(), "needs"))
      << failing.last_error();
  EXPECT_EQ(failing.last_success_unix_s(), 0);

  const std::string log = cluster.server(0).Stderr();
  EXPECT_EQ(CountLines(log, "checkpoint failed:"), 1) << log;
  EXPECT_LE(CountLines(log, "checkpoint"), 4) << log;
  for (const std::string& name : ListDir(checkpoint_dir + "/shard-0-of-1")) {
    EXPECT_FALSE(absl::StrContains(name, "tmp")) << name;
  }

  absl::StatusOr<int> metrics_port =
      testing::WaitForPortFile(metrics_port_file, absl::Seconds(10));
  ASSERT_TRUE(metrics_port.ok()) << metrics_port.status();
  absl::StatusOr<testing::HttpResponse> page =
      HttpGet(*metrics_port, "/metrics");
  ASSERT_TRUE(page.ok()) << page.status();
  absl::StatusOr<double> no_space =
      MetricValue(page->body, "pstrain_checkpoint_failures_total",
                  {{"reason", "no_space"}, {"shard", "0"}});
  ASSERT_TRUE(no_space.ok()) << no_space.status();
  EXPECT_GE(*no_space, 3);
  EXPECT_EQ(MetricValue(page->body, "pstrain_checkpoint_failures_total",
                        {{"reason", "read_only"}, {"shard", "0"}})
                .value_or(-1),
            0);
  EXPECT_EQ(MetricValue(page->body,
                        "pstrain_checkpoint_last_success_timestamp_seconds",
                        {{"shard", "0"}})
                .value_or(-1),
            0);
  EXPECT_GE(MetricValue(page->body, "pstrain_checkpoint_failing_seconds",
                        {{"shard", "0"}})
                .value_or(-1),
            10);

  // Room comes back: the checkpoint follows within one interval (2 s), not
  // at the end of the backoff (8 s by now).
  ASSERT_EQ(std::remove(filler.c_str()), 0);
  const absl::Time freed = absl::Now();
  ASSERT_TRUE(cluster
                  .WaitForStats(
                      [](const StatsResponse& s) {
                        return s.checkpoint().written() >= 1;
                      },
                      absl::Seconds(2))
                  .ok())
      << "no checkpoint within 2 s of freeing the disk";
  std::cerr << "checkpoint " << absl::Now() - freed << " after freeing\n";
  stats = cluster.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const CheckpointStats& recovered = (*stats)[0].checkpoint();
  EXPECT_EQ(recovered.failing_tries(), 0);
  EXPECT_GT(recovered.last_success_unix_s(), 0);
  EXPECT_GT(recovered.last_bytes(), 0);
  EXPECT_GT(recovered.last_duration_s(), 0);
  EXPECT_EQ(CountLines(cluster.server(0).Stderr(), "checkpoints recovered"), 1)
      << cluster.server(0).Stderr();
  page = HttpGet(*metrics_port, "/metrics");
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_GT(MetricValue(page->body,
                        "pstrain_checkpoint_last_success_timestamp_seconds",
                        {{"shard", "0"}})
                .value_or(-1),
            0);
  EXPECT_GE(MetricValue(page->body, "pstrain_checkpoint_written_total",
                        {{"shard", "0"}})
                .value_or(-1),
            1);
  EXPECT_GT(
      MetricValue(page->body, "pstrain_checkpoint_last_bytes", {{"shard", "0"}})
          .value_or(-1),
      0);

  // A restore resumes from it.
  (*worker)->Signal(SIGKILL);
  ASSERT_TRUE((*worker)->Wait(absl::Seconds(10)).ok());
  cluster.KillServer(0);
  ASSERT_TRUE(cluster.RestartServer(0).ok());
  const std::string restart_log = cluster.server(0).Stderr();
  EXPECT_TRUE(
      absl::StrContains(restart_log, checkpoint_dir + "/shard-0-of-1/ckpt-"))
      << restart_log;
  EXPECT_TRUE(absl::StrContains(restart_log, "restored")) << restart_log;
  stats = cluster.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GT((*stats)[0].checkpoint().last_success_unix_s(), 0);
  EXPECT_GT((*stats)[0].version(), 0);
}

// The disk turns read-only during the job (a shared volume remounted): the
// tries back off, are counted as read_only, the newest good checkpoint is
// kept, and checkpoints resume once it is writable again.
TEST(CheckpointStorageTest, DiskTurningReadOnlyMidJobBacksOffAndResumes) {
  const std::string dir = TestDir() + "/turns_read_only";
  const std::string mount_point = dir + "/disk";
  absl::StatusOr<std::unique_ptr<ScopedMount>> mount =
      ScopedMount::Tmpfs(mount_point, 4 << 20);
  if (!mount.ok()) {
    GTEST_SKIP() << "this machine does not allow a tmpfs mount ("
                 << mount.status() << "); run as root to test it";
  }
  const std::string checkpoint_dir = mount_point + "/checkpoints";
  ClusterOptions options;
  options.server_flags = {"--checkpoint_dir=" + checkpoint_dir,
                          "--checkpoint_every_s=0.5"};
  absl::StatusOr<std::unique_ptr<TestCluster>> started =
      TestCluster::Start(options, "turns_read_only");
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& cluster = **started;
  absl::StatusOr<std::unique_ptr<Process>> worker =
      cluster.StartWorker(0, 1, EndlessWorkerFlags());
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE(cluster
                  .WaitForStats(
                      [](const StatsResponse& s) {
                        return s.checkpoint().written() >= 1;
                      },
                      absl::Seconds(30))
                  .ok());

  ASSERT_TRUE(Remount(mount_point, MS_RDONLY).ok());
  // 4 s of a read-only disk: tries 1 s, 2 s apart, so 2 or 3 (the old poll
  // made one every 2 ms).
  ASSERT_TRUE(cluster
                  .WaitForStats(
                      [](const StatsResponse& s) {
                        return s.checkpoint().failing_s() >= 4;
                      },
                      absl::Seconds(30))
                  .ok());
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const CheckpointStats failing = (*stats)[0].checkpoint();
  EXPECT_GE(failing.failures().at("read_only"), 2);
  EXPECT_LE(failing.failures().at("read_only"), 4);
  EXPECT_TRUE(absl::StrContains(failing.last_error(), "Read-only file system"))
      << failing.last_error();
  EXPECT_GT(failing.last_success_unix_s(), 0);
  EXPECT_EQ(CountLines(cluster.server(0).Stderr(), "checkpoint failed:"), 1)
      << cluster.server(0).Stderr();
  bool kept = false;
  for (const std::string& name : ListDir(checkpoint_dir + "/shard-0-of-1")) {
    kept |= absl::StartsWith(name, "ckpt-");
    EXPECT_FALSE(absl::StrContains(name, "tmp")) << name;
  }
  EXPECT_TRUE(kept) << "the last good checkpoint is gone";

  ASSERT_TRUE(Remount(mount_point, 0).ok());
  // The next try (backoff at most 4 s by now) succeeds.
  ASSERT_TRUE(cluster
                  .WaitForStats(
                      [&failing](const StatsResponse& s) {
                        return s.checkpoint().written() > failing.written() &&
                               s.checkpoint().failing_tries() == 0;
                      },
                      absl::Seconds(15))
                  .ok());
  EXPECT_EQ(CountLines(cluster.server(0).Stderr(), "checkpoints recovered"), 1)
      << cluster.server(0).Stderr();
}

TEST(CheckpointStorageTest, DirectoryRemovedMidJobIsRecreated) {
  const std::string dir = TestDir() + "/removed";
  const std::string checkpoint_dir = dir + "/checkpoints";
  std::filesystem::create_directories(dir);
  ClusterOptions options;
  options.server_flags = {"--checkpoint_dir=" + checkpoint_dir,
                          "--checkpoint_every_s=0.5"};
  absl::StatusOr<std::unique_ptr<TestCluster>> started =
      TestCluster::Start(options, "removed");
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& cluster = **started;
  absl::StatusOr<std::unique_ptr<Process>> worker =
      cluster.StartWorker(0, 1, EndlessWorkerFlags());
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE(cluster
                  .WaitForStats(
                      [](const StatsResponse& s) {
                        return s.checkpoint().written() >= 1;
                      },
                      absl::Seconds(30))
                  .ok());
  std::filesystem::remove_all(checkpoint_dir);
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const int64_t written = (*stats)[0].checkpoint().written();
  // A write under way while the directory went may fail once (then backs
  // off 1 s); the next one recreates it.
  ASSERT_TRUE(cluster
                  .WaitForStats(
                      [written](const StatsResponse& s) {
                        return s.checkpoint().written() >= written + 2;
                      },
                      absl::Seconds(15))
                  .ok());
  bool found = false;
  for (const std::string& name : ListDir(checkpoint_dir + "/shard-0-of-1")) {
    found |= absl::StartsWith(name, "ckpt-");
  }
  EXPECT_TRUE(found) << "no checkpoint in the recreated " << checkpoint_dir;
}

}  // namespace
}  // namespace pstrain
