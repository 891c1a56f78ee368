/* narwhal._crelay: the token relay's loop in C (see narwhal/router/relay.py).
 *
 * A Relay waits on the engine sockets of the streams it carries with an epoll object of
 * its own, in a thread that holds the GIL only to hand a stream back. It forwards a read
 * only when the read is self-contained: whole chunks of whole one-line "data:" events,
 * each a token event of the usual shape (narwhal.engines.sse.scan_token_event), each
 * with the compact id the router rewrites (narwhal.router.requests.StreamShaper). Any
 * other read is handed back untouched (Job.raw) for the Python path to take as if it had
 * read it itself, so the rules live in one place and this file only recognises their
 * plainest case. tests/test_crelay.py holds shape() to the Python path, byte for byte.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RECV_SIZE 65536
#define MAX_IDP 512

enum { R_NONE = 0, R_RAW = 1, R_EOF = 2, R_ERROR = 3, R_UNSENT = 4, R_SILENT = 5, R_RELEASED = 6, R_CLOSED = 7 };

typedef struct JobObject {
    PyObject_HEAD
    int src, dst, chunked, strip, carried, done;
    Py_ssize_t max_event;
    double silence_s, last_activity, last_token;
    long long tokens;
    int reason, err;
    char *raw; size_t raw_len;
    char *unsent; size_t unsent_len;
    char idp[MAX_IDP]; size_t idp_len;
    PyObject *callback;
    int queued;                      /* in the adopt (1) or release (2) queue, under the lock */
    struct JobObject *prev, *next;   /* the relay's carried list */
    struct JobObject *link;          /* the adopt or release queue, under the lock */
    struct JobObject *dlink;         /* the loop's done list */
    struct JobObject *ulink;         /* the loop's list of release requests to let go of */
} JobObject;

typedef struct {
    PyObject_HEAD
    int ep, wake_r, wake_w, closing, running;
    pthread_mutex_t lock;
    JobObject *adopt, *release;   /* under lock */
    JobObject *carried;           /* the loop's */
    JobObject *done;              /* the loop's: handed back, callbacks due */
    JobObject *unref;             /* the loop's: release requests done with (a reference each) */
    char *in, *out;
    size_t out_cap;
} RelayObject;

static PyTypeObject JobType, RelayType;

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------ the plain case */

static const char *find(const char *h, size_t hn, const char *n, size_t nn) {
    if (nn == 0) return h;
    if (hn < nn) return NULL;
    return memmem(h, hn, n, nn);
}

static size_t count_char(const char *p, size_t n, char c) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += (p[i] == c);
    return k;
}

#define LIT(s) s, (sizeof(s) - 1)

/* Token ids in one event's data when it has the usual shape; 0 otherwise
 * (narwhal.engines.sse.scan_token_event, rule for rule). */
static long scan_token_event(const char *d, size_t n) {
    if (n < 2 || d[0] != '{' || d[n - 1] != '}') return 0;
    const char *key = find(d, n, LIT("\"token_ids\":["));
    if (!key) return 0;
    const char *start = key + 13;
    const char *end = memchr(start, ']', (size_t)(d + n - start));
    if (!end) return 0;
    if (find(end, (size_t)(d + n - end), LIT("\"token_ids\":["))) return 0;
    int nonspace = 0;
    long commas = 0;
    for (const char *p = start; p < end; p++) {
        char c = *p;
        if (c == ',') { commas++; nonspace = 1; }
        else if (c >= '0' && c <= '9') nonspace = 1;
        else if (c != ' ') return 0;
    }
    if (!nonspace) return 0;
    if (!find(d, n, LIT("\"finish_reason\":null"))) return 0;
    if (find(d, n, LIT("\"error\""))) return 0;
    if (find(d, n, LIT("\"usage\"")) && !find(d, n, LIT("\"usage\":null"))) return 0;
    if (count_char(d, n, '{') != count_char(d, n, '}')) return 0;
    if (count_char(d, n, '[') != count_char(d, n, ']')) return 0;
    return commas + 1;
}

typedef struct { char *p; size_t len, cap; } Buf;

static int buf_put(Buf *b, const char *s, size_t n) {
    if (b->len + n > b->cap) return -1;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}

/* ``ev`` (one event, "data: ...\n\n") without the compact member ``key`` and its value
 * (narwhal.router.requests._cut); in place, returns the new length. */
static size_t cut(char *ev, size_t n, const char *key, size_t kn) {
    const char *i = find(ev, n, key, kn);
    if (!i) return n;
    size_t at = (size_t)(i - ev), j = at + kn;
    size_t stop;
    if (n - j >= 4 && memcmp(ev + j, "null", 4) == 0) stop = j + 4;
    else if (j < n && ev[j] == '[') {
        const char *close = memchr(ev + j, ']', n - j);
        if (!close) return n;
        stop = (size_t)(close - ev) + 1;
    } else return n;
    memmove(ev + at, ev + stop, n - stop);
    return n - (stop - at);
}

/* One event as the client's, appended to ``out``; -1 when it needs the Python path. */
static int shape_event(Buf *out, const char *ev, size_t n, const JobObject *job, char *scratch) {
    static const char compact[] = "data: {\"id\":\"";
    size_t cn = sizeof(compact) - 1;
    if (n < cn || memcmp(ev, compact, cn) != 0) return -1;
    const char *q = memchr(ev + cn, '"', n - cn);
    if (!q || q[-1] == '\\') return -1;
    size_t rest = (size_t)(ev + n - (q + 1));
    if (!job->strip || !find(q + 1, rest, LIT("token_ids"))) {
        if (buf_put(out, job->idp, job->idp_len) < 0 || buf_put(out, q + 1, rest) < 0) return -1;
        return 0;
    }
    memcpy(scratch, job->idp, job->idp_len);
    memcpy(scratch + job->idp_len, q + 1, rest);
    size_t m = job->idp_len + rest;
    m = cut(scratch, m, LIT(",\"prompt_token_ids\":"));
    m = cut(scratch, m, LIT(",\"token_ids\":"));
    if (find(scratch, m, LIT("token_ids"))) return -1;
    return buf_put(out, scratch, m);
}

/* A read as the client's bytes (framed) and its token count, when it is the plain case:
 * whole chunks (never the last one) of whole one-line data: events, all tokens of the
 * usual shape with the compact id. Returns the count, or -1 (hand the read back). */
static long plain_read(const char *data, size_t n, const JobObject *job, Buf *payload, Buf *out, char *scratch) {
    size_t pos = 0;
    payload->len = 0;
    while (pos < n) {
        size_t size = 0, k = pos;
        while (k < n && k - pos < 9) {
            char c = data[k];
            int v;
            if (c >= '0' && c <= '9') v = c - '0';
            else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
            else if (c >= 'A' && c <= 'F') v = c - 'A' + 10;
            else break;
            size = size * 16 + (size_t)v;
            k++;
        }
        if (k == pos || k - pos > 8 || k + 1 >= n || data[k] != '\r' || data[k + 1] != '\n') return -1;
        if (size == 0) return -1;  /* the last chunk: the body's end */
        size_t start = k + 2;
        if (size > n || start + size + 2 > n) return -1;
        if (data[start + size] != '\r' || data[start + size + 1] != '\n') return -1;
        if (buf_put(payload, data + start, size) < 0) return -1;
        pos = start + size + 2;
    }
    const char *p = payload->p;
    size_t len = payload->len;
    if (len < 2 || (Py_ssize_t)len > job->max_event || p[len - 2] != '\n' || p[len - 1] != '\n') return -1;
    if (memchr(p, '\r', len)) return -1;
    /* Events: split on "\n\n" (the last one's ends the payload). */
    Buf body = {out->p + 16, 0, out->cap - 18};   /* room for the chunk's size line */
    long total = 0;
    size_t at = 0;
    while (at < len) {
        const char *e = find(p + at, len - at, LIT("\n\n"));
        size_t elen = (size_t)(e - (p + at));   /* e is never NULL: the payload ends with it */
        const char *ev = p + at;
        if (elen < 6 || memcmp(ev, "data: ", 6) != 0 || memchr(ev, '\n', elen)) return -1;
        long count = scan_token_event(ev + 6, elen - 6);
        if (count <= 0) return -1;
        if (shape_event(&body, ev, elen + 2, job, scratch) < 0) return -1;
        total += count;
        at += elen + 2;
    }
    if (job->chunked) {
        char head[20];
        int hn = snprintf(head, sizeof head, "%zx\r\n", body.len);
        memmove(out->p + 16 - hn, head, (size_t)hn);   /* the size line right before the body */
        memcpy(out->p + 16 + body.len, "\r\n", 2);
        out->len = (size_t)hn + body.len + 2;
        memmove(out->p, out->p + 16 - hn, out->len);
    } else {
        memmove(out->p, out->p + 16, body.len);
        out->len = body.len;
    }
    return total;
}

/* ------------------------------------------------------------------ the loop */

static void wake(RelayObject *r) {
    char c = 0;
    pthread_mutex_lock(&r->lock);
    int fd = r->wake_w;
    ssize_t w = fd >= 0 ? write(fd, &c, 1) : 0;
    (void)w;   /* a full pipe: a wake-up is pending already */
    pthread_mutex_unlock(&r->lock);
}

static void unlink_carried(RelayObject *r, JobObject *j) {
    if (j->prev) j->prev->next = j->next; else if (r->carried == j) r->carried = j->next;
    if (j->next) j->next->prev = j->prev;
    j->prev = j->next = NULL;
}

static void hand_back(RelayObject *r, JobObject *j, int reason) {
    if (j->done) return;
    j->done = 1;
    j->reason = reason;
    if (j->carried) {
        epoll_ctl(r->ep, EPOLL_CTL_DEL, j->src, NULL);
        unlink_carried(r, j);
        j->carried = 0;
    }
    j->dlink = r->done;
    r->done = j;
}

static char *copy(const char *p, size_t n) {
    char *c = PyMem_RawMalloc(n ? n : 1);
    if (c && n) memcpy(c, p, n);
    return c;
}

static void step(RelayObject *r, JobObject *j, char *scratch) {
    ssize_t n = read(j->src, r->in, RECV_SIZE);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        j->err = errno;
        hand_back(r, j, R_ERROR);
        return;
    }
    if (n == 0) { hand_back(r, j, R_EOF); return; }
    double now = mono();
    j->last_activity = now;
    Buf payload = {scratch + 2 * RECV_SIZE + 2 * MAX_IDP, 0, RECV_SIZE};
    Buf out = {r->out, 0, r->out_cap};
    long count = plain_read(r->in, (size_t)n, j, &payload, &out, scratch);
    if (count <= 0) {
        j->raw = copy(r->in, (size_t)n);
        j->raw_len = j->raw ? (size_t)n : 0;
        if (!j->raw) j->err = ENOMEM;
        hand_back(r, j, j->raw ? R_RAW : R_ERROR);
        return;
    }
    j->tokens += count;
    j->last_token = now;
    size_t sent = 0;
    while (sent < out.len) {
        ssize_t w = send(j->dst, out.p + sent, out.len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) { if (errno == EINTR) continue; break; }
        sent += (size_t)w;
    }
    if (sent < out.len) {
        j->unsent = copy(out.p + sent, out.len - sent);
        j->unsent_len = j->unsent ? out.len - sent : 0;
        hand_back(r, j, R_UNSENT);
    }
}

static double earliest(RelayObject *r) {
    double t = -1;
    for (JobObject *j = r->carried; j; j = j->next) {
        double due = j->last_activity + j->silence_s;
        if (!isfinite(due)) continue;
        if (t < 0 || due < t) t = due;
    }
    return t;
}

/* Take new streams and released ones (under the lock); 1 once closing with none left. */
static int control(RelayObject *r) {
    char sink[256];
    while (read(r->wake_r, sink, sizeof sink) > 0) {}
    pthread_mutex_lock(&r->lock);
    JobObject *adopt = r->adopt, *release = r->release;
    r->adopt = r->release = NULL;
    for (JobObject *j = adopt; j; j = j->link) j->queued = 0;
    for (JobObject *j = release; j; j = j->link) j->queued = 0;
    int closing = r->closing;
    pthread_mutex_unlock(&r->lock);
    for (JobObject *j = adopt, *nx; j; j = nx) {
        nx = j->link;
        j->link = NULL;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = j};
        if (epoll_ctl(r->ep, EPOLL_CTL_ADD, j->src, &ev) < 0) {
            j->err = errno;   /* not carried: the task relays it */
            hand_back(r, j, R_RELEASED);
            continue;
        }
        j->carried = 1;
        j->next = r->carried;
        if (r->carried) r->carried->prev = j;
        r->carried = j;
    }
    for (JobObject *j = release, *nx; j; j = nx) {
        nx = j->link;
        j->link = NULL;
        hand_back(r, j, R_RELEASED);
        j->ulink = r->unref;   /* the request's reference, let go of with the GIL */
        r->unref = j;
    }
    if (closing)
        while (r->carried) hand_back(r, r->carried, R_CLOSED);
    return closing;
}

/* With the GIL: each handed-back job's callback, then the relay's reference to it. */
static void finish(RelayObject *r) {
    for (JobObject *u = r->unref, *nx; u; u = nx) {
        nx = u->ulink;
        u->ulink = NULL;
        Py_DECREF(u);
    }
    r->unref = NULL;
    JobObject *j = r->done;
    r->done = NULL;
    while (j) {
        JobObject *nx = j->dlink;
        j->dlink = NULL;
        PyObject *cb = j->callback;
        j->callback = NULL;
        if (cb) {
            PyObject *res = PyObject_CallNoArgs(cb);
            if (!res) PyErr_WriteUnraisable(cb);
            Py_XDECREF(res);
            Py_DECREF(cb);
        }
        Py_DECREF(j);
        j = nx;
    }
}

static PyObject *Relay_run(RelayObject *r, PyObject *Py_UNUSED(ignored)) {
    if (r->running || r->ep < 0) { PyErr_SetString(PyExc_RuntimeError, "the relay runs already or has stopped"); return NULL; }
    r->running = 1;
    char *scratch = PyMem_RawMalloc(3 * RECV_SIZE + 4 * MAX_IDP);
    if (!scratch) return PyErr_NoMemory();
    struct epoll_event evs[64];
    double next_check = -1;
    int stop = 0;
    while (!stop) {
        Py_BEGIN_ALLOW_THREADS
        for (;;) {
            int timeout = -1;
            if (next_check >= 0) {
                double left = next_check - mono();
                timeout = left <= 0 ? 0 : left > 60 ? 60000 : (int)(left * 1000) + 1;
            }
            int n = epoll_wait(r->ep, evs, 64, timeout);
            if (n < 0 && errno != EINTR) {
                /* Cannot wait any more: every stream goes back to its task, and the relay
                 * takes no more (adopt() refuses: the router relays on the event loop). */
                pthread_mutex_lock(&r->lock);
                r->closing = 1;
                pthread_mutex_unlock(&r->lock);
                control(r);
                stop = 1;
                break;
            }
            if (n < 0) n = 0;
            for (int i = 0; i < n; i++) {
                JobObject *j = evs[i].data.ptr;
                if (j == NULL) {
                    if (control(r)) stop = 1;
                    double e = earliest(r);
                    if (e >= 0 && (next_check < 0 || e < next_check)) next_check = e;
                } else if (!j->done) {
                    step(r, j, scratch);
                }
            }
            if (next_check >= 0 && mono() >= next_check) {
                double now = mono();
                for (JobObject *j = r->carried, *nx; j; j = nx) {
                    nx = j->next;
                    if (j->last_activity + j->silence_s <= now) hand_back(r, j, R_SILENT);
                }
                next_check = earliest(r);
            }
            if (r->done || r->unref || stop) break;
        }
        Py_END_ALLOW_THREADS
        finish(r);
    }
    PyMem_RawFree(scratch);
    /* Stopped: its descriptors go now, not when the object is collected. */
    pthread_mutex_lock(&r->lock);
    r->closing = 1;
    close(r->ep);
    close(r->wake_r);
    close(r->wake_w);
    r->ep = r->wake_r = r->wake_w = -1;
    pthread_mutex_unlock(&r->lock);
    r->running = 0;
    Py_RETURN_NONE;
}

static PyObject *Relay_adopt(RelayObject *r, PyObject *args) {
    int src, dst, chunked, strip;
    Py_ssize_t max_event;
    double silence_s, last_activity;
    const char *idp;
    Py_ssize_t idp_len;
    PyObject *callback;
    if (!PyArg_ParseTuple(args, "iiy#ppnddO", &src, &dst, &idp, &idp_len, &strip, &chunked, &max_event,
                          &silence_s, &last_activity, &callback))
        return NULL;
    if (idp_len > MAX_IDP) { PyErr_SetString(PyExc_ValueError, "id prefix too long"); return NULL; }
    if (r->closing) { PyErr_SetString(PyExc_RuntimeError, "the relay is closed"); return NULL; }
    JobObject *j = PyObject_New(JobObject, &JobType);
    if (!j) return NULL;
    j->src = src; j->dst = dst; j->chunked = chunked; j->strip = strip; j->carried = 0; j->done = 0;
    j->max_event = max_event; j->silence_s = silence_s; j->last_activity = last_activity;
    j->last_token = 0; j->tokens = 0; j->reason = R_NONE; j->err = 0;
    j->raw = j->unsent = NULL; j->raw_len = j->unsent_len = 0;
    memcpy(j->idp, idp, (size_t)idp_len); j->idp_len = (size_t)idp_len;
    Py_INCREF(callback); j->callback = callback;
    j->prev = j->next = j->link = j->dlink = j->ulink = NULL;
    Py_INCREF(j);   /* the relay's, until it hands the job back */
    pthread_mutex_lock(&r->lock);
    j->link = r->adopt; r->adopt = j; j->queued = 1;
    pthread_mutex_unlock(&r->lock);
    wake(r);
    return (PyObject *)j;
}

static PyObject *Relay_release(RelayObject *r, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &JobType)) { PyErr_SetString(PyExc_TypeError, "a Job"); return NULL; }
    JobObject *j = (JobObject *)arg;
    pthread_mutex_lock(&r->lock);
    if (r->ep < 0) {   /* stopped: it handed everything back */
        pthread_mutex_unlock(&r->lock);
        Py_RETURN_NONE;
    }
    if (j->queued == 1) {   /* not adopted yet: move it to the release queue */
        JobObject **q = &r->adopt;
        while (*q && *q != j) q = &(*q)->link;
        if (*q) *q = j->link;
        j->queued = 0;
    }
    if (j->queued == 0) {   /* the loop skips one it handed back already */
        Py_INCREF(j);       /* the loop's, until it has read the request */
        j->link = r->release;
        r->release = j;
        j->queued = 2;
    }
    pthread_mutex_unlock(&r->lock);
    wake(r);
    Py_RETURN_NONE;
}

static PyObject *Relay_close(RelayObject *r, PyObject *Py_UNUSED(ignored)) {
    pthread_mutex_lock(&r->lock);
    r->closing = 1;
    pthread_mutex_unlock(&r->lock);
    wake(r);
    Py_RETURN_NONE;
}

static int Relay_init(RelayObject *r, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "")) return -1;
    pthread_mutex_init(&r->lock, NULL);
    r->ep = epoll_create1(EPOLL_CLOEXEC);
    int p[2];
    if (r->ep < 0 || pipe2(p, O_NONBLOCK | O_CLOEXEC) < 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    r->wake_r = p[0]; r->wake_w = p[1];
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(r->ep, EPOLL_CTL_ADD, r->wake_r, &ev) < 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    r->out_cap = 2 * RECV_SIZE + 64;
    r->in = PyMem_RawMalloc(RECV_SIZE);
    r->out = PyMem_RawMalloc(r->out_cap);
    if (!r->in || !r->out) { PyErr_NoMemory(); return -1; }
    return 0;
}

static PyObject *Relay_new(PyTypeObject *t, PyObject *a, PyObject *k) {
    RelayObject *r = (RelayObject *)t->tp_alloc(t, 0);
    if (r) { r->ep = r->wake_r = r->wake_w = -1; }
    return (PyObject *)r;
}

static void Relay_dealloc(RelayObject *r) {
    if (r->ep >= 0) close(r->ep);
    if (r->wake_r >= 0) close(r->wake_r);
    if (r->wake_w >= 0) close(r->wake_w);
    PyMem_RawFree(r->in);
    PyMem_RawFree(r->out);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef Relay_methods[] = {
    {"run", (PyCFunction)Relay_run, METH_NOARGS, "Run the loop (in a thread of its own) until close()."},
    {"adopt", (PyCFunction)Relay_adopt, METH_VARARGS,
     "adopt(src, dst, id_prefix, strip_ids, chunked, max_event, silence_s, last_activity, callback) -> Job"},
    {"release", (PyCFunction)Relay_release, METH_O, "Hand a job back as soon as the loop can."},
    {"close", (PyCFunction)Relay_close, METH_NOARGS, "Hand every job back and end run()."},
    {NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "narwhal._crelay.Relay",
    .tp_basicsize = sizeof(RelayObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Relay_new,
    .tp_init = (initproc)Relay_init,
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_methods = Relay_methods,
};

static void Job_dealloc(JobObject *j) {
    PyMem_RawFree(j->raw);
    PyMem_RawFree(j->unsent);
    Py_XDECREF(j->callback);
    PyObject_Free(j);
}

static PyObject *Job_get(JobObject *j, void *which) {
    switch ((int)(Py_intptr_t)which) {
    case 0: return PyLong_FromLongLong(j->tokens);
    case 1: return PyFloat_FromDouble(j->last_token);
    case 2: return PyFloat_FromDouble(j->last_activity);
    case 3: return PyLong_FromLong(j->reason);
    case 4: return PyLong_FromLong(j->err);
    case 5: return PyBytes_FromStringAndSize(j->raw ? j->raw : "", (Py_ssize_t)j->raw_len);
    case 6: return PyBytes_FromStringAndSize(j->unsent ? j->unsent : "", (Py_ssize_t)j->unsent_len);
    default: return PyBool_FromLong(j->done);
    }
}

static PyGetSetDef Job_getset[] = {
    {"tokens", (getter)Job_get, NULL, "tokens forwarded", (void *)0},
    {"last_token", (getter)Job_get, NULL, "CLOCK_MONOTONIC seconds of the last token's read", (void *)1},
    {"last_activity", (getter)Job_get, NULL, "CLOCK_MONOTONIC seconds of the last read", (void *)2},
    {"reason", (getter)Job_get, NULL, "why it was handed back", (void *)3},
    {"errno", (getter)Job_get, NULL, "the read's errno (reason ERROR)", (void *)4},
    {"raw", (getter)Job_get, NULL, "a read handed back untouched", (void *)5},
    {"unsent", (getter)Job_get, NULL, "framed bytes the client's socket did not take", (void *)6},
    {"done", (getter)Job_get, NULL, "handed back", (void *)7},
    {NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "narwhal._crelay.Job",
    .tp_basicsize = sizeof(JobObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Job_dealloc,
    .tp_getset = Job_getset,
};

/* shape(data, id_prefix, strip_ids, chunked, max_event) -> (count, framed) | None */
static PyObject *shape(PyObject *mod, PyObject *args) {
    const char *data, *idp;
    Py_ssize_t n, idp_len, max_event;
    int strip, chunked;
    if (!PyArg_ParseTuple(args, "y#y#ppn", &data, &n, &idp, &idp_len, &strip, &chunked, &max_event)) return NULL;
    if (idp_len > MAX_IDP || n > RECV_SIZE) Py_RETURN_NONE;
    JobObject job;
    memset(&job, 0, sizeof job);
    job.strip = strip; job.chunked = chunked; job.max_event = max_event;
    memcpy(job.idp, idp, (size_t)idp_len); job.idp_len = (size_t)idp_len;
    char *scratch = PyMem_RawMalloc(3 * RECV_SIZE + 4 * MAX_IDP);
    char *outp = PyMem_RawMalloc(2 * RECV_SIZE + 64);
    if (!scratch || !outp) { PyMem_RawFree(scratch); PyMem_RawFree(outp); return PyErr_NoMemory(); }
    Buf payload = {scratch + 2 * RECV_SIZE + 2 * MAX_IDP, 0, RECV_SIZE};
    Buf out = {outp, 0, 2 * RECV_SIZE + 64};
    long count = plain_read(data, (size_t)n, &job, &payload, &out, scratch);
    PyObject *res = count > 0 ? Py_BuildValue("(ly#)", count, out.p, (Py_ssize_t)out.len) : Py_NewRef(Py_None);
    PyMem_RawFree(scratch);
    PyMem_RawFree(outp);
    return res;
}

static PyMethodDef module_methods[] = {
    {"shape", shape, METH_VARARGS, "A read as the loop forwards it: (count, framed bytes), or None."},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "narwhal._crelay", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__crelay(void) {
    if (PyType_Ready(&RelayType) < 0 || PyType_Ready(&JobType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&RelayType);
    PyModule_AddObject(m, "Relay", (PyObject *)&RelayType);
    Py_INCREF(&JobType);
    PyModule_AddObject(m, "Job", (PyObject *)&JobType);
    PyModule_AddIntConstant(m, "RAW", R_RAW);
    PyModule_AddIntConstant(m, "EOF", R_EOF);
    PyModule_AddIntConstant(m, "ERROR", R_ERROR);
    PyModule_AddIntConstant(m, "UNSENT", R_UNSENT);
    PyModule_AddIntConstant(m, "SILENT", R_SILENT);
    PyModule_AddIntConstant(m, "RELEASED", R_RELEASED);
    PyModule_AddIntConstant(m, "CLOSED", R_CLOSED);
    return m;
}
