/* A C client that drives every socket call the library intercepts over one connection to an
 * echo server (shm_probe serve thread 1), checking results as a program would. Built by
 * tests/api.rs with -O2 -D_FORTIFY_SOURCE=2, so that glibc routes read/recv/recvfrom/poll
 * through __read_chk, __recv_chk, __recvfrom_chk and __poll_chk.
 *
 * usage: api_client PORT     prints "ok api mapped N" (N: connection regions mapped)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static void fail(const char *what) {
    fprintf(stderr, "FAIL %s: %s\n", what, strerror(errno));
    exit(1);
}

#define CHECK(cond, what)     \
    do {                      \
        if (!(cond)) fail(what); \
    } while (0)

/* A length the compiler cannot see, so that FORTIFY keeps the _chk calls. */
static volatile size_t runtime_len = 64;

static int mapped(void) {
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[512];
    int count = 0;
    if (!maps) return 0;
    while (fgets(line, sizeof line, maps))
        if (strstr(line, "/dev/shm/flatmesh-shm-") && !strstr(line, "-arena-")) count++;
    fclose(maps);
    return count;
}

/* Reads exactly n bytes with read() (__read_chk: buf's size is known). */
static void read_exact(int fd, char *out, size_t n) {
    char buf[64];
    size_t got = 0;
    while (got < n) {
        size_t want = n - got < runtime_len ? n - got : runtime_len;
        ssize_t r = read(fd, buf, want);
        CHECK(r > 0, "read");
        memcpy(out + got, buf, (size_t)r);
        got += (size_t)r;
    }
}

static void roundtrip(int fd, const char *msg, const char *what) {
    size_t n = strlen(msg);
    char back[256];
    CHECK(write(fd, msg, n) == (ssize_t)n, what);
    read_exact(fd, back, n);
    if (memcmp(back, msg, n) != 0) {
        fprintf(stderr, "FAIL %s: echo differs\n", what);
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: api_client PORT\n");
        return 2;
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1]))};
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0, "socket");
    CHECK(connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0, "connect");

    /* write / read */
    roundtrip(fd, "hello", "write/read");

    /* getsockopt and getpeername still reach the kernel (control path). */
    int type = 0;
    socklen_t type_len = sizeof type;
    CHECK(getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 && type == SOCK_STREAM, "getsockopt");
    struct sockaddr_in peer;
    socklen_t peer_len = sizeof peer;
    CHECK(getpeername(fd, (struct sockaddr *)&peer, &peer_len) == 0 && peer.sin_port == addr.sin_port, "getpeername");

    /* send / recv with MSG_WAITALL (__recv_chk) */
    char buf[64];
    CHECK(send(fd, "send-recv", 9, 0) == 9, "send");
    CHECK(recv(fd, buf, runtime_len < 9 ? runtime_len : 9, MSG_WAITALL) == 9 && memcmp(buf, "send-recv", 9) == 0, "recv MSG_WAITALL");

    /* sendto / recvfrom (__recvfrom_chk) */
    CHECK(sendto(fd, "to-from", 7, 0, NULL, 0) == 7, "sendto");
    struct sockaddr_storage from;
    socklen_t from_len = sizeof from;
    size_t got = 0;
    char from_data[64];
    while (got < 7) {
        char piece[64];
        size_t want = 7 - got < runtime_len ? 7 - got : runtime_len;
        ssize_t r = recvfrom(fd, piece, want, 0, (struct sockaddr *)&from, &from_len);
        CHECK(r > 0, "recvfrom");
        memcpy(from_data + got, piece, (size_t)r);
        got += (size_t)r;
    }
    CHECK(memcmp(from_data, "to-from", 7) == 0, "recvfrom data");

    /* writev / readv across three buffers each */
    struct iovec out[3] = {{"ab", 2}, {"cde", 3}, {"fghi", 4}};
    CHECK(writev(fd, out, 3) == 9, "writev");
    char a[4], b[2], c[3];
    struct iovec in[3] = {{a, 4}, {b, 2}, {c, 3}};
    size_t total = 0;
    while (total < 9) {
        /* a short readv is legal: retry with the rest */
        struct iovec rest[3];
        int count = 0;
        size_t skip = total;
        for (int i = 0; i < 3; i++) {
            if (skip >= in[i].iov_len) {
                skip -= in[i].iov_len;
                continue;
            }
            rest[count].iov_base = (char *)in[i].iov_base + skip;
            rest[count].iov_len = in[i].iov_len - skip;
            skip = 0;
            count++;
        }
        ssize_t r = readv(fd, rest, count);
        CHECK(r > 0, "readv");
        total += (size_t)r;
    }
    CHECK(memcmp(a, "abcd", 4) == 0 && memcmp(b, "ef", 2) == 0 && memcmp(c, "ghi", 3) == 0, "readv data");

    /* sendmsg / recvmsg */
    struct iovec mout = {"message", 7};
    struct msghdr mh = {.msg_iov = &mout, .msg_iovlen = 1};
    CHECK(sendmsg(fd, &mh, MSG_NOSIGNAL) == 7, "sendmsg");
    char mbuf[7];
    struct iovec min = {mbuf, 7};
    struct msghdr rh = {.msg_iov = &min, .msg_iovlen = 1};
    CHECK(recvmsg(fd, &rh, MSG_WAITALL) == 7 && memcmp(mbuf, "message", 7) == 0, "recvmsg");

    /* MSG_PEEK leaves the bytes in place; FIONREAD counts them */
    CHECK(send(fd, "peek", 4, 0) == 4, "send peek");
    struct pollfd one = {.fd = fd, .events = POLLIN};
    CHECK(poll(&one, 1, 5000) == 1 && (one.revents & POLLIN), "poll before peek");
    usleep(20000); /* all 4 bytes back */
    int pending = 0;
    CHECK(ioctl(fd, FIONREAD, &pending) == 0 && pending == 4, "FIONREAD");
    CHECK(recv(fd, buf, runtime_len < 4 ? runtime_len : 4, MSG_PEEK) == 4 && memcmp(buf, "peek", 4) == 0, "MSG_PEEK");
    CHECK(recv(fd, buf, runtime_len < 4 ? runtime_len : 4, 0) == 4 && memcmp(buf, "peek", 4) == 0, "recv after peek");

    /* O_NONBLOCK with fcntl, then blocking again with FIONBIO */
    int flags = fcntl(fd, F_GETFL);
    CHECK(fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, "F_SETFL");
    errno = 0;
    CHECK(read(fd, buf, runtime_len) == -1 && errno == EAGAIN, "nonblocking read on empty");
    CHECK(recv(fd, buf, runtime_len, MSG_DONTWAIT) == -1 && errno == EAGAIN, "MSG_DONTWAIT");
    int off = 0;
    CHECK(ioctl(fd, FIONBIO, &off) == 0, "FIONBIO");
    roundtrip(fd, "blocking-again", "after FIONBIO");

    /* poll (__poll_chk), select and epoll with a pipe in the same set */
    int pipefd[2];
    CHECK(pipe(pipefd) == 0, "pipe");
    CHECK(write(pipefd[1], "p", 1) == 1, "pipe write");
    CHECK(write(fd, "x", 1) == 1, "write for poll");
    usleep(20000);
    struct pollfd set[2] = {{.fd = fd, .events = POLLIN}, {.fd = pipefd[0], .events = POLLIN}};
    nfds_t nset = (nfds_t)(runtime_len / 32); /* 2, unknown to the compiler */
    CHECK(poll(set, nset, 5000) == 2 && (set[0].revents & POLLIN) && (set[1].revents & POLLIN), "poll mixed");
    fd_set readable;
    FD_ZERO(&readable);
    FD_SET(fd, &readable);
    FD_SET(pipefd[0], &readable);
    struct timeval tv = {5, 0};
    int maxfd = fd > pipefd[0] ? fd : pipefd[0];
    CHECK(select(maxfd + 1, &readable, NULL, NULL, &tv) == 2 && FD_ISSET(fd, &readable) && FD_ISSET(pipefd[0], &readable), "select mixed");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    CHECK(ep >= 0, "epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 1};
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0, "epoll_ctl socket");
    ev.data.u64 = 2;
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, pipefd[0], &ev) == 0, "epoll_ctl pipe");
    /* the same instance through a dup of the epoll fd (as mio's registry clone does) */
    int ep2 = dup(ep);
    CHECK(ep2 >= 0, "dup epoll");
    struct epoll_event events[4];
    int n = epoll_wait(ep2, events, 4, 5000);
    CHECK(n == 2, "epoll_wait mixed");
    for (int i = 0; i < n; i++) CHECK(events[i].data.u64 == 1 || events[i].data.u64 == 2, "epoll data is the application's");
    char x;
    CHECK(read(fd, &x, 1) == 1 && x == 'x', "read after readiness");
    CHECK(read(pipefd[0], &x, 1) == 1 && x == 'p', "pipe read");
    close(ep2);
    close(ep);

    /* dup, dup2, dup3 share the connection */
    int d1 = dup(fd);
    roundtrip(d1, "via-dup", "dup");
    int d2 = dup2(fd, 100);
    CHECK(d2 == 100, "dup2");
    roundtrip(d2, "via-dup2", "dup2");
    int d3 = dup3(fd, 101, O_CLOEXEC);
    CHECK(d3 == 101, "dup3");
    roundtrip(d3, "via-dup3", "dup3");
    int d4 = fcntl(fd, F_DUPFD_CLOEXEC, 110);
    CHECK(d4 >= 110, "F_DUPFD_CLOEXEC");
    roundtrip(d4, "via-dupfd", "F_DUPFD");
    close(d1);
    close(d2);
    close(d3);
    close(d4);
    roundtrip(fd, "original-still-works", "after closing dups");

    /* fork: the child and then the parent use the connection */
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        roundtrip(fd, "from-the-child", "child");
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0, "child");
    roundtrip(fd, "parent-after-fork", "parent after fork");

    /* vfork: the child closes its copy of the socket and execs (a spawner's usual steps); the
     * parent's connection must not notice (a vfork child runs in the parent's memory) */
    struct timeval limit = {10, 0}; /* a lost connection fails in 10 s instead of hanging */
    CHECK(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit) == 0, "SO_RCVTIMEO");
    pid_t spawned = vfork();
    if (spawned == 0) {
        close(fd);
        execl("/bin/true", "true", (char *)NULL);
        _exit(127);
    }
    CHECK(spawned > 0, "vfork");
    CHECK(waitpid(spawned, &status, 0) == spawned && WIFEXITED(status) && WEXITSTATUS(status) == 0, "vfork child");
    roundtrip(fd, "parent-after-vfork", "parent after vfork");

    int regions = mapped();

    /* half-close: the echo server sees EOF, echoes what is left and closes */
    CHECK(write(fd, "last", 4) == 4, "last write");
    CHECK(shutdown(fd, SHUT_WR) == 0, "shutdown");
    read_exact(fd, buf, 4);
    CHECK(memcmp(buf, "last", 4) == 0, "last echo");
    CHECK(read(fd, buf, runtime_len) == 0, "EOF after half-close");
    CHECK(close(fd) == 0, "close");
    printf("ok api mapped %d\n", regions);
    return 0;
}
