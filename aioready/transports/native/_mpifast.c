/* The MPI transport's commonest message in one C call each way (see __init__.py).
 *
 * send:  write a lone CPU tensor's inline message (fixed header, the plan's descriptor block,
 *        padding, the tensor's bytes, padding) into one bytes object, MPI_Isend and MPI_Test it.
 * send_parts: from ZERO_COPY payload bytes, the header alone, and the header, the tensor's own
 *        memory and the zero padding through one hindexed datatype (MPITransport._isend_parts).
 * send_head: a header-only message (no tensors: the reserving policy's notices), as send.
 * send_multi: the inline message of several CPU tensors (None slots among them), as send.
 * probe: MPI_Improbe up to `tries` times; on a match read source, tag and size, receive the
 *        message into a bytearray with MPI_Imrecv + MPI_Test, and if a receive plan of its
 *        length takes it (the very checks of wire_plans.ReceivePlans.message) build its tensor
 *        and its Message. Anything else goes back to Python as it is, which takes the path it
 *        took without this helper (and raises what is wrong there). A header-only NOTICE that
 *        the plan takes goes, where a notice handler is given, straight to it as four integers
 *        (step, stage, microbatch, tag): no Message is built for it. Several tensors (None slots
 *        among them) are viewed from the plan's views where asked (`multi`).
 *
 * board_post / board_read: the notice board's rings (notice_board.py): a record written into
 *        the ring of (this rank, a peer) of a shared mapping, and the new records of the rings
 *        (any peer, this rank) of one step handed to a callback, those of older steps dropped
 *        without a call; single producer, single consumer, the
 *        counters published with release stores and read with acquire loads.
 *
 * The wire format is header.py's `_FIXED` = "<HBBIHIIB" (19 bytes), little-endian.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <stdint.h>
#include <string.h>

#define FIXED 19

static PyObject *g_kinds, *g_message, *g_ndarray, *g_from_numpy;
static long g_control, g_magic, g_version, g_notice = -1;
static PyObject *s_desc, *s_n, *s_one, *s_views;

static PyObject *mpi_error(const char *call, int code) {
    char text[MPI_MAX_ERROR_STRING + 1];
    int len = 0;
    if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
    text[len] = 0;
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (MPI error %d)", call, text, code);
    return NULL;
}

/* mpi4py writes a handle as an unsigned integer (an MPICH int handle sign-extended) */
static PyObject *handle_out(int h) {
    return PyLong_FromUnsignedLongLong((unsigned long long)(long long)h);
}

static int handle_in(PyObject *o) {
    return (int)PyLong_AsUnsignedLongLongMask(o);
}

static void put16(char *p, unsigned long v) { p[0] = (char)v; p[1] = (char)(v >> 8); }
static void put32(char *p, unsigned long v) {
    p[0] = (char)v; p[1] = (char)(v >> 8); p[2] = (char)(v >> 16); p[3] = (char)(v >> 24);
}
static unsigned long get16(const unsigned char *p) { return p[0] | (p[1] << 8); }
static unsigned long get32(const unsigned char *p) {
    return p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned long)p[3] << 24);
}

/* an integer argument in [0, hi], else -1 (no exception left set) */
/* Whether a fastcall function `name` got its `n` arguments; else a TypeError set. */
static int takes(const char *name, Py_ssize_t nargs, Py_ssize_t n) {
    if (nargs == n) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, n);
    return 0;
}

static long bounded(PyObject *o, long hi) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    return v < 0 || v > hi ? -1 : v;
}

PyDoc_STRVAR(setup_doc,
"setup(kinds, control, Message, ndarray, from_numpy, magic, version, notice=-1)");
static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *kinds, *message, *ndarray, *from_numpy;
    long control, magic, version;
    long notice = -1;
    if (!PyArg_ParseTuple(args, "O!lOOOll|l", &PyTuple_Type, &kinds, &control, &message,
                          &ndarray, &from_numpy, &magic, &version, &notice))
        return NULL;
    Py_INCREF(kinds); Py_XSETREF(g_kinds, kinds);
    Py_INCREF(message); Py_XSETREF(g_message, message);
    Py_INCREF(ndarray); Py_XSETREF(g_ndarray, ndarray);
    Py_INCREF(from_numpy); Py_XSETREF(g_from_numpy, from_numpy);
    g_control = control; g_magic = magic; g_version = version; g_notice = notice;
    Py_RETURN_NONE;
}

/* the arguments send and send_parts share: comm, dest, tag, the header's fields, the
 * descriptor block, the tensor's pointer and bytes, the payload's offset */
typedef struct {
    MPI_Comm comm;
    long dest, tag, kind, step, stage, mb, msgtag, n, off;
    void *ptr;
    PyObject *desc;
} message_args;

/* the route and header fields every send takes first (comm, dest, tag, kind, step, stage,
   microbatch, msgtag): 1 if each is in range, else 0 (the caller answers NotImplemented) */
static int parse_route(PyObject *const *args, message_args *m) {
    m->comm = (MPI_Comm)handle_in(args[0]);
    m->dest = bounded(args[1], 0x7fffffffL); m->tag = bounded(args[2], 0x7fffffffL);
    m->kind = bounded(args[3], 0xff); m->step = bounded(args[4], 0xffffffffL);
    m->stage = bounded(args[5], 0xffff); m->mb = bounded(args[6], 0xffffffffL);
    m->msgtag = bounded(args[7], 0xffffffffL);
    return (m->dest | m->tag | m->kind | m->step | m->stage | m->mb | m->msgtag) >= 0;
}

/* 1: parsed; 0: a field out of range (the caller answers NotImplemented); -1: an exception */
static int parse_message(PyObject *const *args, message_args *m) {
    int route = parse_route(args, m);
    m->n = bounded(args[10], 0x7fffffffL); m->off = bounded(args[11], 0x7fffffffL);
    m->ptr = PyLong_AsVoidPtr(args[9]);
    if (m->ptr == NULL && PyErr_Occurred()) return -1;
    if (!PyBytes_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "desc must be bytes");
        return -1;
    }
    m->desc = args[8];
    return route && (m->n | m->off) >= 0 && FIXED + PyBytes_GET_SIZE(m->desc) <= m->off;
}

/* the fixed header of `count` tensors */
static void write_fixed(char *p, const message_args *m, char count) {
    put16(p, (unsigned long)g_magic); p[2] = (char)g_version; p[3] = (char)m->kind;
    put32(p + 4, m->step); put16(p + 8, m->stage); put32(p + 10, m->mb);
    put32(p + 14, m->msgtag);
    p[18] = count;
}

/* the fixed header, the descriptor block and its zero padding up to the payload's offset */
static void write_header(char *p, const message_args *m) {
    Py_ssize_t dlen = PyBytes_GET_SIZE(m->desc);
    write_fixed(p, m, 1);
    memcpy(p + FIXED, PyBytes_AS_STRING(m->desc), dlen);
    memset(p + FIXED + dlen, 0, m->off - FIXED - dlen);
}

/* MPI_Isend and MPI_Test of buf's `total` bytes: None if MPI completed it at once (buf
 * released), else (buf, the request's handle) to keep until it completes; NULL: an error */
static PyObject *isend_test(PyObject *buf, long total, const message_args *m) {
    MPI_Request req;
    int flag = 0, rc = MPI_Isend(PyBytes_AS_STRING(buf), (int)total, MPI_BYTE, (int)m->dest,
                                 (int)m->tag, m->comm, &req);
    if (rc != MPI_SUCCESS) { Py_DECREF(buf); return mpi_error("MPI_Isend", rc); }
    rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) { Py_DECREF(buf); return mpi_error("MPI_Test", rc); }
    if (flag) { Py_DECREF(buf); Py_RETURN_NONE; }
    PyObject *h = handle_out(req);
    if (h == NULL) { Py_DECREF(buf); return NULL; }
    return Py_BuildValue("(NN)", buf, h);
}

PyDoc_STRVAR(send_doc,
"send(comm, dest, tag, kind, step, stage, microbatch, msgtag, desc, ptr, n, off, total)\n"
"The inline message of the n bytes at ptr, sent: None if MPI completed it at once, else\n"
"(its bytes, the request's handle) to keep until it completes; NotImplemented if a field\n"
"does not fit the header (the Python plan raises what it raises).");
static PyObject *send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes("send", nargs, 13)) return NULL;
    message_args m;
    int ok = parse_message(args, &m);
    if (ok < 0) return NULL;
    long total = bounded(args[12], 0x7fffffffL);
    if (!ok || m.off + m.n > total) Py_RETURN_NOTIMPLEMENTED;
    PyObject *buf = PyBytes_FromStringAndSize(NULL, total);
    if (buf == NULL) return NULL;
    char *p = PyBytes_AS_STRING(buf);
    write_header(p, &m);
    memcpy(p + m.off, m.ptr, m.n);
    memset(p + m.off + m.n, 0, total - m.off - m.n);
    return isend_test(buf, total, &m);
}

PyDoc_STRVAR(send_head_doc,
"send_head(comm, dest, tag, kind, step, stage, microbatch, msgtag, total)\n"
"A header-only message (tensor count 0: a notice): the fixed header and zero padding up to\n"
"`total` bytes, what the Python plan packs for it; sent and answered as `send`.");
static PyObject *send_head(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes("send_head", nargs, 9)) return NULL;
    message_args m;
    int route = parse_route(args, &m);
    long total = bounded(args[8], 0x7fffffffL);
    if (!route || total < FIXED)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *buf = PyBytes_FromStringAndSize(NULL, total);
    if (buf == NULL) return NULL;
    char *p = PyBytes_AS_STRING(buf);
    write_fixed(p, &m, 0);
    memset(p + FIXED, 0, total - FIXED);
    return isend_test(buf, total, &m);
}

PyDoc_STRVAR(send_parts_doc,
"send_parts(comm, dest, tag, kind, step, stage, microbatch, msgtag, desc, ptr, n, off, tail,\n"
"           test)\n"
"The same message with the payload sent from the tensor's memory: the header (off bytes, with\n"
"its padding), the n bytes at ptr and tail zero bytes through one hindexed datatype. None if\n"
"`test` and MPI completed it at once, else (the header's bytes, the request's handle): both,\n"
"and the tensor, kept until it completes; NotImplemented as `send`.");
static PyObject *send_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char zeros[16];
    if (!takes("send_parts", nargs, 14)) return NULL;
    message_args m;
    int ok = parse_message(args, &m);
    if (ok < 0) return NULL;
    long tail = bounded(args[12], sizeof(zeros));
    int test = PyObject_IsTrue(args[13]);
    if (test < 0) return NULL;
    if (!ok || tail < 0) Py_RETURN_NOTIMPLEMENTED;
    PyObject *head = PyBytes_FromStringAndSize(NULL, m.off);
    if (head == NULL) return NULL;
    char *p = PyBytes_AS_STRING(head);
    write_header(p, &m);
    int lengths[3] = {(int)m.off, (int)m.n, (int)tail};
    MPI_Aint where[3];
    MPI_Datatype type;
    MPI_Request req;
    int flag = 0, rc = MPI_Get_address(p, &where[0]);
    if (rc == MPI_SUCCESS) rc = MPI_Get_address(m.ptr, &where[1]);
    if (rc == MPI_SUCCESS) rc = MPI_Get_address(zeros, &where[2]);
    if (rc == MPI_SUCCESS) rc = MPI_Type_create_hindexed(tail ? 3 : 2, lengths, where, MPI_BYTE,
                                                         &type);
    if (rc != MPI_SUCCESS) { Py_DECREF(head); return mpi_error("MPI_Type_create_hindexed", rc); }
    rc = MPI_Type_commit(&type);
    if (rc == MPI_SUCCESS)
        rc = MPI_Isend(MPI_BOTTOM, 1, type, (int)m.dest, (int)m.tag, m.comm, &req);
    MPI_Type_free(&type);  /* (a send that uses it still completes) */
    if (rc != MPI_SUCCESS) { Py_DECREF(head); return mpi_error("MPI_Isend", rc); }
    if (test) {
        rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) { Py_DECREF(head); return mpi_error("MPI_Test", rc); }
        if (flag) { Py_DECREF(head); Py_RETURN_NONE; }
    }
    PyObject *h = handle_out(req);
    if (h == NULL) { Py_DECREF(head); return NULL; }
    return Py_BuildValue("(NN)", head, h);
}

/* a header-only notice's fields to `on_notice`: Py_True, or (the exception it raised,) */
static PyObject *notice_to(PyObject *on_notice, const unsigned char *p) {
    PyObject *fields[4] = {PyLong_FromUnsignedLong(get32(p + 4)),
                           PyLong_FromUnsignedLong(get16(p + 8)),
                           PyLong_FromUnsignedLong(get32(p + 10)),
                           PyLong_FromUnsignedLong(get32(p + 14))};
    PyObject *out = NULL;
    if (fields[0] && fields[1] && fields[2] && fields[3]) {
        PyObject *r = PyObject_Vectorcall(on_notice, fields, 4, NULL);
        if (r != NULL) {
            Py_DECREF(r);
            out = Py_NewRef(Py_True);
        } else if (PyErr_ExceptionMatches(PyExc_Exception)) {  /* the handler's: to Python */
#if PY_VERSION_HEX >= 0x030C0000
            PyObject *value = PyErr_GetRaisedException();
#else
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
            Py_XDECREF(type); Py_XDECREF(tb);
#endif
            out = value == NULL ? NULL : PyTuple_Pack(1, value);
            Py_XDECREF(value);
        }
    }
    for (int i = 0; i < 4; i++) Py_XDECREF(fields[i]);
    return out;
}

/* one tensor viewing buf as `view` = (shape, numpy dtype, offset) describes */
static PyObject *tensor_of(PyObject *view, PyObject *buf) {
    if (!PyTuple_Check(view) || PyTuple_GET_SIZE(view) != 3) {
        PyErr_SetString(PyExc_TypeError, "a receive plan's view is (shape, dtype, offset)");
        return NULL;
    }
    PyObject *vargs[4] = {PyTuple_GET_ITEM(view, 0), PyTuple_GET_ITEM(view, 1), buf,
                          PyTuple_GET_ITEM(view, 2)};
    PyObject *arr = PyObject_Vectorcall(g_ndarray, vargs, 4, NULL);
    if (arr == NULL) return NULL;
    PyObject *t = PyObject_CallOneArg(g_from_numpy, arr);
    Py_DECREF(arr);
    return t;
}

/* the tensors of a several-tensor plan's `views` (None slots as None), each viewing buf */
static PyObject *several(PyObject *views, PyObject *buf) {
    Py_ssize_t nv = PyList_GET_SIZE(views);
    PyObject *out = PyTuple_New(nv);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nv; i++) {
        PyObject *view = PyList_GET_ITEM(views, i);
        PyObject *t = view == Py_None ? Py_NewRef(Py_None) : tensor_of(view, buf);
        if (t == NULL) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, i, t);
    }
    return out;
}

/* the Message in buf if the receive plan of its length takes it (a notice, where `on_notice`
 * is not None, handed to it: notice_to's answer; several tensors only if `multi`); Py_None if
 * not; NULL: error */
static PyObject *planned(PyObject *plans, PyObject *buf, int count, int src,
                         PyObject *on_notice, int multi) {
    PyObject *key = PyLong_FromLong(count);
    if (key == NULL) return NULL;
    PyObject *plan = PyDict_GetItemWithError(plans, key);  /* borrowed */
    Py_DECREF(key);
    if (plan == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *desc = PyObject_GetAttr(plan, s_desc), *one = NULL, *views = NULL;
    PyObject *nobj = PyObject_GetAttr(plan, s_n), *out = NULL, *tensors = NULL;
    if (desc == NULL || nobj == NULL || !PyBytes_Check(desc)) goto done;
    const unsigned char *p = (const unsigned char *)PyByteArray_AS_STRING(buf);
    Py_ssize_t dlen = PyBytes_GET_SIZE(desc);
    long kind = p[3];
    if (count < FIXED + dlen || (long)get16(p) != g_magic || p[2] != g_version ||
            p[18] != PyLong_AsLong(nobj) || kind >= PyTuple_GET_SIZE(g_kinds) ||
            kind == g_control || memcmp(p + FIXED, PyBytes_AS_STRING(desc), dlen) != 0) {
        out = Py_NewRef(Py_None);  /* not this plan's: the general path decides */
        goto done;
    }
    one = PyObject_GetAttr(plan, s_one);
    if (one == NULL) goto done;
    if (one != Py_None) {  /* (shape, numpy dtype, offset): one view of buf */
        PyObject *t = tensor_of(one, buf);
        if (t == NULL) goto done;
        tensors = PyTuple_Pack(1, t);
        Py_DECREF(t);
    } else {
        views = PyObject_GetAttr(plan, s_views);
        if (views == NULL) goto done;
        if (!PyList_Check(views)) {
            PyErr_SetString(PyExc_TypeError, "a receive plan's views are a list");
            goto done;
        }
        Py_ssize_t nv = PyList_GET_SIZE(views);
        if (nv && !multi) {
            out = Py_NewRef(Py_None);  /* several tensors: the Python plan builds them */
            goto done;
        }
        if (!nv && kind == g_notice && on_notice != Py_None) {  /* the plan's checks made */
            out = notice_to(on_notice, p);
            goto done;
        }
        tensors = nv ? several(views, buf) : PyTuple_New(0);  /* or header only */
    }
    if (tensors == NULL) goto done;
    PyObject *margs[7] = {PyLong_FromUnsignedLong(get32(p + 4)), PyTuple_GET_ITEM(g_kinds, kind),
                          PyLong_FromUnsignedLong(get16(p + 8)),
                          PyLong_FromUnsignedLong(get32(p + 10)), tensors,
                          PyLong_FromUnsignedLong(get32(p + 14)), PyLong_FromLong(src)};
    if (margs[0] && margs[2] && margs[3] && margs[5] && margs[6])
        out = PyObject_Vectorcall(g_message, margs, 7, NULL);
    Py_XDECREF(margs[0]); Py_XDECREF(margs[2]); Py_XDECREF(margs[3]);
    Py_XDECREF(margs[5]); Py_XDECREF(margs[6]);
done:
    Py_XDECREF(desc); Py_XDECREF(nobj); Py_XDECREF(one); Py_XDECREF(views);
    Py_XDECREF(tensors);
    return out;
}

PyDoc_STRVAR(probe_doc,
"probe(comm, tries, max_count, plans, on_notice=None, multi=False)\n"
"    -> None | Message | True | (exc,) | (src, tag, count, buf, handle)\n"
"None: nothing matched in `tries` MPI_Improbe calls. A Message: received, and a receive plan\n"
"of `plans` (length -> plan) took it (one of several tensors only if `multi`). True: a header-only notice the plan took, handed to\n"
"on_notice(step, stage, microbatch, tag) (no Message); (exc,): what on_notice raised.\n"
"Else a tuple: buf a bytearray received (handle 0) or\n"
"being received (handle: its request's); buf None when count > max_count (handle: the matched\n"
"message's, not received: the caller raises).");
static PyObject *probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 4 || nargs > 6 || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "probe(comm, tries, max_count, plans: dict, on_notice=None, multi=False)");
        return NULL;
    }
    if (g_message == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "probe before setup()");
        return NULL;
    }
    MPI_Comm comm = (MPI_Comm)handle_in(args[0]);
    long tries = PyLong_AsLong(args[1]), max_count = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    MPI_Message m;
    MPI_Status status;
    int flag = 0, rc = MPI_SUCCESS, count = 0;
    for (long i = 0; i < tries && !flag; i++) {
        rc = MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, &m, &status);
        if (rc != MPI_SUCCESS) return mpi_error("MPI_Improbe", rc);
    }
    if (!flag) Py_RETURN_NONE;
    rc = MPI_Get_count(&status, MPI_BYTE, &count);
    if (rc != MPI_SUCCESS) return mpi_error("MPI_Get_count", rc);
    int src = status.MPI_SOURCE, tag = status.MPI_TAG;
    if (count < 0 || count > max_count)  /* hostile input: bounded before allocation */
        return Py_BuildValue("(iiiON)", src, tag, count, Py_None, handle_out(m));
    PyObject *buf = PyByteArray_FromStringAndSize(NULL, count);  /* (not zero-filled) */
    if (buf == NULL) return NULL;
    MPI_Request req;
    rc = MPI_Imrecv(PyByteArray_AS_STRING(buf), count, MPI_BYTE, &m, &req);
    if (rc == MPI_SUCCESS) rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) { Py_DECREF(buf); return mpi_error("MPI_Imrecv/MPI_Test", rc); }
    if (!flag)
        return Py_BuildValue("(iiiNN)", src, tag, count, buf, handle_out(req));
    int multi = nargs == 6 ? PyObject_IsTrue(args[5]) : 0;
    if (multi < 0) { Py_DECREF(buf); return NULL; }
    PyObject *msg = planned(args[3], buf, count, src, nargs >= 5 ? args[4] : Py_None, multi);
    if (msg != Py_None) { Py_DECREF(buf); return msg; }  /* a Message, or NULL: its error */
    Py_DECREF(msg);
    return Py_BuildValue("(iiiNi)", src, tag, count, buf, 0);
}

PyDoc_STRVAR(send_multi_doc,
"send_multi(comm, dest, tag, kind, step, stage, microbatch, msgtag, desc, count, parts, total)\n"
"The inline message of `count` tensor slots: the fixed header, the descriptor block `desc`,\n"
"and each part (ptr, n, off) of `parts` copied to its offset, every other byte zero (what\n"
"wire_plans.MultiPlans packs); sent and answered as `send`.");
static PyObject *send_multi(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes("send_multi", nargs, 12)) return NULL;
    message_args m;
    int route = parse_route(args, &m);
    if (!PyBytes_Check(args[8]) || !PyTuple_Check(args[10])) {
        PyErr_SetString(PyExc_TypeError, "send_multi: desc must be bytes, parts a tuple");
        return NULL;
    }
    long count = bounded(args[9], 0xff), total = bounded(args[11], 0x7fffffffL);
    Py_ssize_t dlen = PyBytes_GET_SIZE(args[8]), nparts = PyTuple_GET_SIZE(args[10]);
    if (!route || (count | total) < 0 || FIXED + dlen > total)
        Py_RETURN_NOTIMPLEMENTED;
    void *ptrs[256];
    long sizes[256], offs[256];
    if (nparts > count) Py_RETURN_NOTIMPLEMENTED;
    for (Py_ssize_t i = 0; i < nparts; i++) {
        PyObject *part = PyTuple_GET_ITEM(args[10], i);
        if (!PyTuple_Check(part) || PyTuple_GET_SIZE(part) != 3) {
            PyErr_SetString(PyExc_TypeError, "send_multi: a part is (ptr, n, off)");
            return NULL;
        }
        ptrs[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(part, 0));
        if (ptrs[i] == NULL && PyErr_Occurred()) return NULL;
        sizes[i] = bounded(PyTuple_GET_ITEM(part, 1), 0x7fffffffL);
        offs[i] = bounded(PyTuple_GET_ITEM(part, 2), 0x7fffffffL);
        if (sizes[i] < 0 || offs[i] < FIXED + dlen || offs[i] + sizes[i] > total)
            Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *buf = PyBytes_FromStringAndSize(NULL, total);
    if (buf == NULL) return NULL;
    char *p = PyBytes_AS_STRING(buf);
    memset(p, 0, total);
    write_fixed(p, &m, (char)count);
    memcpy(p + FIXED, PyBytes_AS_STRING(args[8]), dlen);
    for (Py_ssize_t i = 0; i < nparts; i++)
        if (sizes[i]) memcpy(p + offs[i], ptrs[i], sizes[i]);
    return isend_test(buf, total, &m);
}

/* The notice board: for each ordered pair (src, dst) of the n local ranks, the ring at index
 * src * n + dst of the mapping. `head` is written by src alone, `tail` by dst alone, each on its
 * own cache line; a record is written before its head is published (release) and read after
 * the head is seen (acquire), and its slot is reused only after the tail passed it. */
#define BOARD_SLOTS 256  /* a step's notices to a rank that rarely consults its forecast */
typedef struct { uint32_t step, stage, microbatch, tag; double at; } board_record;
typedef struct {
    uint64_t head; char pad_head[56];
    uint64_t tail; char pad_tail[56];
    board_record slots[BOARD_SLOTS];
} board_ring;

/* ring `index` of the board at `base` (a Python int address) */
static board_ring *ring_at(PyObject *base, long index) {
    char *p = (char *)PyLong_AsVoidPtr(base);
    if (p == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the board is closed");
        return NULL;
    }
    return (board_ring *)(p + (size_t)index * sizeof(board_ring));
}

PyDoc_STRVAR(board_post_doc,
"board_post(base, ring, step, stage, microbatch, tag, at) -> bool\n"
"Write the record into ring `ring` of the board mapped at address `base`; False (nothing\n"
"written) when its 256 slots are all unread, or a field does not fit 32 bits.");
static PyObject *board_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes("board_post", nargs, 7)) return NULL;
    long index = PyLong_AsLong(args[1]);
    double at = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred()) return NULL;
    long step = bounded(args[2], 0xffffffffL), stage = bounded(args[3], 0xffffffffL);
    long mb = bounded(args[4], 0xffffffffL), tag = bounded(args[5], 0xffffffffL);
    if ((step | stage | mb | tag) < 0 || index < 0) Py_RETURN_FALSE;
    board_ring *r = ring_at(args[0], index);
    if (r == NULL) return NULL;
    uint64_t head = __atomic_load_n(&r->head, __ATOMIC_RELAXED);
    if (head - __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE) >= BOARD_SLOTS) Py_RETURN_FALSE;
    board_record *rec = &r->slots[head % BOARD_SLOTS];
    rec->step = (uint32_t)step; rec->stage = (uint32_t)stage;
    rec->microbatch = (uint32_t)mb; rec->tag = (uint32_t)tag; rec->at = at;
    __atomic_store_n(&r->head, head + 1, __ATOMIC_RELEASE);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(board_read_doc,
"board_read(base, first, stride, count, step, on_notice) -> (read, skipped)\n"
"Consume the new records of the rings first, first + stride, ... (count rings) of the board\n"
"at `base`, oldest first: those of a step before `step` without a call (skipped), those of\n"
"`step` each handed to on_notice(step, stage, microbatch, tag, at) (read); a ring stops at\n"
"its first record of a later step (a sender's steps only grow), which stays for the step\n"
"that reads it. on_notice None: the records of `step` stay too (only the older ones go).\n"
"A record is consumed before its call: what on_notice raises propagates, the rest stay.\n"
"OverflowError: a ring's counters say more records than it holds (a peer's bytes).");
static PyObject *board_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!takes("board_read", nargs, 6)) return NULL;
    long first = PyLong_AsLong(args[1]), stride = PyLong_AsLong(args[2]);
    long count = PyLong_AsLong(args[3]), step = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (first < 0 || stride < 0 || count < 0 || step < 0) {
        PyErr_SetString(PyExc_ValueError, "board_read: first, stride, count and step are >= 0");
        return NULL;
    }
    PyObject *on_notice = args[5] == Py_None ? NULL : args[5];
    uint64_t upto = (uint64_t)step + (on_notice != NULL);  /* records of steps below: consumed */
    long read = 0, skipped = 0;
    for (long i = 0; i < count; i++) {
        board_ring *r = ring_at(args[0], first + i * stride);
        if (r == NULL) return NULL;
        uint64_t tail = __atomic_load_n(&r->tail, __ATOMIC_RELAXED);
        uint64_t head = __atomic_load_n(&r->head, __ATOMIC_ACQUIRE);
        if (head - tail > BOARD_SLOTS) {  /* a peer's counter: input, bounded */
            PyErr_Format(PyExc_OverflowError, "ring %ld holds %llu records unread, at most %d",
                         first + i * stride, (unsigned long long)(head - tail), BOARD_SLOTS);
            return NULL;
        }
        while (tail != head) {  /* (records posted meanwhile: the next read) */
            board_record rec = r->slots[tail % BOARD_SLOTS];
            if ((uint64_t)rec.step >= upto) break;  /* a later step's: left for it */
            __atomic_store_n(&r->tail, ++tail, __ATOMIC_RELEASE);
            if ((uint64_t)rec.step < (uint64_t)step) {
                skipped++;
                continue;
            }
            PyObject *fields[5] = {PyLong_FromUnsignedLong(rec.step),
                                   PyLong_FromUnsignedLong(rec.stage),
                                   PyLong_FromUnsignedLong(rec.microbatch),
                                   PyLong_FromUnsignedLong(rec.tag), PyFloat_FromDouble(rec.at)};
            PyObject *out = NULL;
            if (fields[0] && fields[1] && fields[2] && fields[3] && fields[4])
                out = PyObject_Vectorcall(on_notice, fields, 5, NULL);
            for (int k = 0; k < 5; k++) Py_XDECREF(fields[k]);
            if (out == NULL) return NULL;
            Py_DECREF(out);
            read++;
        }
    }
    return Py_BuildValue("(ll)", read, skipped);
}

PyDoc_STRVAR(board_ring_bytes_doc, "board_ring_bytes() -> the size of one ring in bytes");
static PyObject *board_ring_bytes(PyObject *self, PyObject *unused) {
    return PyLong_FromSize_t(sizeof(board_ring));
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, setup_doc},
    {"send", (PyCFunction)(void (*)(void))send, METH_FASTCALL, send_doc},
    {"send_parts", (PyCFunction)(void (*)(void))send_parts, METH_FASTCALL, send_parts_doc},
    {"send_head", (PyCFunction)(void (*)(void))send_head, METH_FASTCALL, send_head_doc},
    {"send_multi", (PyCFunction)(void (*)(void))send_multi, METH_FASTCALL, send_multi_doc},
    {"probe", (PyCFunction)(void (*)(void))probe, METH_FASTCALL, probe_doc},
    {"board_post", (PyCFunction)(void (*)(void))board_post, METH_FASTCALL, board_post_doc},
    {"board_read", (PyCFunction)(void (*)(void))board_read, METH_FASTCALL, board_read_doc},
    {"board_ring_bytes", board_ring_bytes, METH_NOARGS, board_ring_bytes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mpifast",
    "The MPI transport's plan send and receive in C (aioready.transports.native).", -1, methods};

PyMODINIT_FUNC PyInit__mpifast(void) {
    s_desc = PyUnicode_InternFromString("desc");
    s_n = PyUnicode_InternFromString("n");
    s_one = PyUnicode_InternFromString("one");
    s_views = PyUnicode_InternFromString("views");
    if (!s_desc || !s_n || !s_one || !s_views) return NULL;
    return PyModule_Create(&module);
}
