/* LD_PRELOAD shim for the crash campaign's power-loss model (crash_campaign.py --power-loss).
 *
 * `kill -9` of the server leaves the host's page cache alone, so every write the server made
 * survives it, synced or not. To model a power cut, this shim keeps an undo log of the backing
 * file: before each write to it, the bytes about to be overwritten are appended to the log; an
 * fdatasync/fsync of the backing that returns 0 marks everything logged before it started as
 * durable. After the kill, the campaign writes back the old bytes of the writes not covered by a
 * sync (all of them, or a random subset: a disk's volatile cache may have kept any of them), so
 * the backing holds what a power cut could have left; only what FLUSH/FUA made durable is certain.
 *
 * Environment: CB_UNDO_BACKING (the backing file, matched by device and inode after each open),
 * CB_UNDO_LOG (created/truncated), CB_UNDO_LIE=1 (never count a sync: the negative control,
 * a server whose syncs do nothing). Without the first two the shim does nothing.
 *
 * Log records: 'W' u64 offset, u64 length, old bytes; 'S' u64 log position (records before it are
 * durable); 'D' u64 log position of one 'W' record: that write alone is durable (a pwritev2 with
 * RWF_DSYNC or RWF_SYNC that wrote everything: O_DSYNC semantics for that range, nothing else).
 * When a sync finds no write logged since it began, the log is truncated instead.
 * Writes to the backing are serialised by one mutex (old bytes, log, write), so the log order is
 * the write order. Any failure of the shim itself aborts the server: a silent gap would make the
 * model lenient.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FD 4096

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int log_fd = -1, rd_fd = -1, lie;
static dev_t target_dev;
static ino_t target_ino;
static unsigned char tracked[MAX_FD];
static uint64_t log_len, gen;

static int (*real_open)(const char *, int, ...);
static int (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_openat64)(int, const char *, int, ...);
static int (*real_close)(int);
static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off_t);
static ssize_t (*real_pwritev)(int, const struct iovec *, int, off_t);
static ssize_t (*real_pwritev2)(int, const struct iovec *, int, off_t, int);
static int (*real_fdatasync)(int);
static int (*real_fsync)(int);
static int (*real_fallocate)(int, int, off_t, off_t);

static void die(const char *what) {
  fprintf(stderr, "crash_undo_shim: %s: %s\n", what, strerror(errno));
  abort();
}

#define RESOLVE(name)                                  \
  do {                                                 \
    real_##name = dlsym(RTLD_NEXT, #name);             \
  } while (0)

__attribute__((constructor)) static void init(void) {
  RESOLVE(open);
  RESOLVE(open64);
  RESOLVE(openat);
  RESOLVE(openat64);
  RESOLVE(close);
  RESOLVE(write);
  RESOLVE(writev);
  RESOLVE(pwrite);
  RESOLVE(pwrite64);
  RESOLVE(pwritev);
  RESOLVE(pwritev2);
  RESOLVE(fdatasync);
  RESOLVE(fsync);
  RESOLVE(fallocate);
  const char *b = getenv("CB_UNDO_BACKING"), *l = getenv("CB_UNDO_LOG");
  if (!b || !l)
    return;
  struct stat st;
  if (stat(b, &st) != 0)
    die("stat CB_UNDO_BACKING");
  target_dev = st.st_dev;
  target_ino = st.st_ino;
  lie = getenv("CB_UNDO_LIE") != NULL && strcmp(getenv("CB_UNDO_LIE"), "1") == 0;
  log_fd = real_open(l, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
  rd_fd = real_open(b, O_RDONLY | O_CLOEXEC);
  if (log_fd < 0 || rd_fd < 0)
    die("open log or backing");
  fprintf(stderr, "crash_undo_shim: undo log %s for %s%s\n", l, b, lie ? " (LIE: syncs not counted)" : "");
}

static void note_open(int fd) {
  struct stat st;
  if (fd < 0 || log_fd < 0 || fd >= MAX_FD)
    return;
  if (fstat(fd, &st) == 0 && st.st_dev == target_dev && st.st_ino == target_ino) {
    tracked[fd] = 1;
    fprintf(stderr, "crash_undo_shim: tracking fd %d\n", fd);
  }
}

static int is_tracked(int fd) { return fd >= 0 && fd < MAX_FD && tracked[fd]; }

static void log_all(const void *p, size_t n) {
  const char *c = p;
  while (n) {
    ssize_t w = real_write(log_fd, c, n);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      die("write undo log");
    }
    c += w;
    n -= (size_t)w;
  }
}

/* Logs the old bytes of [off, off+n); the caller holds mu. */
static void log_old(off_t off, size_t n) {
  char *old = malloc(n ? n : 1);
  if (!old)
    die("malloc");
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(rd_fd, old + got, n - got, off + (off_t)got);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      die("pread old bytes");
    }
    if (r == 0) {  /* past the end: nothing to restore there */
      memset(old + got, 0, n - got);
      break;
    }
    got += (size_t)r;
  }
  unsigned char hdr[17];
  uint64_t o = (uint64_t)off, len = n;
  hdr[0] = 'W';
  memcpy(hdr + 1, &o, 8);
  memcpy(hdr + 9, &len, 8);
  log_all(hdr, sizeof hdr);
  log_all(old, n);
  log_len += sizeof hdr + n;
  free(old);
}

static int sync_common(int fd, int (*real)(int)) {
  if (!is_tracked(fd))
    return real(fd);
  pthread_mutex_lock(&mu);
  uint64_t start = log_len, g = gen;
  pthread_mutex_unlock(&mu);
  int rc = real(fd);
  if (rc == 0 && !lie) {
    int saved = errno;
    pthread_mutex_lock(&mu);
    if (g == gen) {  /* else a sync that began no earlier already truncated the log */
      if (log_len == start) {
        if (ftruncate(log_fd, 0) != 0)
          die("truncate undo log");
        log_len = 0;
        gen++;
      } else {
        unsigned char rec[9];
        rec[0] = 'S';
        memcpy(rec + 1, &start, 8);
        log_all(rec, sizeof rec);
        log_len += sizeof rec;
      }
    }
    pthread_mutex_unlock(&mu);
    errno = saved;
  }
  return rc;
}

#define OPEN_MODE(flags, mode)               \
  mode_t mode = 0;                           \
  if (((flags) & O_CREAT) || ((flags) & O_TMPFILE) == O_TMPFILE) { \
    va_list ap;                              \
    va_start(ap, flags);                     \
    mode = va_arg(ap, mode_t);               \
    va_end(ap);                              \
  }

int open(const char *path, int flags, ...) {
  OPEN_MODE(flags, mode);
  int fd = real_open(path, flags, mode);
  note_open(fd);
  return fd;
}

int open64(const char *path, int flags, ...) {
  OPEN_MODE(flags, mode);
  int fd = real_open64(path, flags, mode);
  note_open(fd);
  return fd;
}

int openat(int dirfd, const char *path, int flags, ...) {
  OPEN_MODE(flags, mode);
  int fd = real_openat(dirfd, path, flags, mode);
  note_open(fd);
  return fd;
}

int openat64(int dirfd, const char *path, int flags, ...) {
  OPEN_MODE(flags, mode);
  int fd = real_openat64(dirfd, path, flags, mode);
  note_open(fd);
  return fd;
}

int close(int fd) {
  if (fd >= 0 && fd < MAX_FD)
    tracked[fd] = 0;
  return real_close(fd);
}

static ssize_t logged_pwrite(ssize_t (*real)(int, const void *, size_t, off_t), int fd, const void *buf, size_t n,
                             off_t off) {
  if (!is_tracked(fd))
    return real(fd, buf, n, off);
  pthread_mutex_lock(&mu);
  log_old(off, n);
  ssize_t r = real(fd, buf, n, off);
  int saved = errno;
  pthread_mutex_unlock(&mu);
  errno = saved;
  return r;
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) { return logged_pwrite(real_pwrite, fd, buf, n, off); }

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
  return logged_pwrite(real_pwrite64, fd, buf, n, off);
}

static size_t iov_len(const struct iovec *iov, int cnt) {
  size_t n = 0;
  for (int i = 0; i < cnt; i++)
    n += iov[i].iov_len;
  return n;
}

ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
  if (!is_tracked(fd))
    return real_pwritev(fd, iov, cnt, off);
  pthread_mutex_lock(&mu);
  log_old(off, iov_len(iov, cnt));
  ssize_t r = real_pwritev(fd, iov, cnt, off);
  int saved = errno;
  pthread_mutex_unlock(&mu);
  errno = saved;
  return r;
}

ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {
  if (!is_tracked(fd))
    return real_pwritev2(fd, iov, cnt, off, flags);
  if (off == -1) {  /* current file position: not used by the server; refuse rather than guess */
    errno = EINVAL;
    die("pwritev2 at the file position on the backing");
  }
  pthread_mutex_lock(&mu);
  uint64_t at = log_len;
  size_t n = iov_len(iov, cnt);
  log_old(off, n);
  ssize_t r = real_pwritev2(fd, iov, cnt, off, flags);
  int saved = errno;
  if (r >= 0 && (size_t)r == n && (flags & (RWF_DSYNC | RWF_SYNC)) && !lie) {
    unsigned char rec[9];
    rec[0] = 'D';
    memcpy(rec + 1, &at, 8);
    log_all(rec, sizeof rec);
    log_len += sizeof rec;
  }
  pthread_mutex_unlock(&mu);
  errno = saved;
  return r;
}

int fallocate(int fd, int mode, off_t off, off_t len) {
  if (!is_tracked(fd))
    return real_fallocate(fd, mode, off, len);
  pthread_mutex_lock(&mu);
  log_old(off, (size_t)len);
  int r = real_fallocate(fd, mode, off, len);
  int saved = errno;
  pthread_mutex_unlock(&mu);
  errno = saved;
  return r;
}

/* Writes at the file position are not logged: the server has none on the backing. Should that
 * change, stop loudly instead of modelling less than happened. */
ssize_t write(int fd, const void *buf, size_t n) {
  if (is_tracked(fd)) {
    errno = ENOTSUP;
    die("write() at the file position on the backing is not modelled");
  }
  return real_write(fd, buf, n);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
  if (is_tracked(fd)) {
    errno = ENOTSUP;
    die("writev() at the file position on the backing is not modelled");
  }
  return real_writev(fd, iov, cnt);
}

int fdatasync(int fd) { return sync_common(fd, real_fdatasync); }

int fsync(int fd) { return sync_common(fd, real_fsync); }
