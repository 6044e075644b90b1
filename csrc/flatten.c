/* flatten_state_dict: torch's flatten_state_dict (distributed/checkpoint/
 * _nested_dict.py over _traverse.traverse_state_dict) as one C walk.
 *
 * The result must be exactly torch's: the same keys (".".join of the
 * object path, str() of each mapping key), in the same order, the same
 * OBJ_PATH tuples (str parts for mapping keys, int parts for list
 * indices), the very same value objects, and the same exceptions.  torch's
 * rules, which the functions below follow one for one:
 *
 *   _traverse_obj(path, value):
 *     Mapping       -> for k, v in value.items(): recurse(path + (str(k),), v)
 *     _is_terminal  -> leaf: flat[".".join(map(str, path))] = value
 *                      (ValueError "duplicated flatten key ..." if present)
 *     list          -> for i, v in enumerate(value): recurse(path + (i,), v)
 *   _is_terminal(value): a Mapping never is; a list is unless an entry is a
 *     tensor, a Mapping or a non-terminal list; anything else (a tuple too)
 *     always is.
 *
 * Types whose answers cannot change (exact dict, list, tuple, str, int,
 * float, bool, None, bytes, torch.Tensor, torch.nn.Parameter) are
 * classified by pointer; anything else gets the very isinstance() calls
 * torch makes, and non-dict Mappings (OrderedDict included) are walked
 * through their own items().  Where this walk cannot be sure to match
 * torch it returns None instead and dcpx/coordination/flatten.py calls torch's
 * function: a Mapping whose items() yields something other than 2-tuples,
 * a key whose str() is not an exact str, nesting deeper than MAX_DEPTH or
 * a RecursionError (torch then raises its own, or succeeds), and a
 * collections.abc registry in which one of the exact types above became a
 * Mapping.  Called with the GIL held; runs whatever Python code the state
 * dict's own objects run under torch's walk (items(), __str__, __class__).
 */
#include "dcpx.h"

/* Deeper than this, torch's walk decides (its recursion limit, not ours,
 * says where a RecursionError starts).  State dicts nest a handful deep. */
#define MAX_DEPTH 100

enum {
    K_DICT,     /* exact dict: a Mapping, walked with PyDict_Next */
    K_MAPPING,  /* any other Mapping: walked through its items() */
    K_LIST,     /* exact list */
    K_LISTLIKE, /* isinstance(v, list) but not an exact list */
    K_TENSOR,   /* exact torch.Tensor / torch.nn.Parameter: a leaf */
    K_LEAF,     /* exact builtin scalar, str, bytes, tuple, None: a leaf */
    K_OTHER,    /* a leaf; whether it is a tensor is asked when needed */
};

typedef struct {
    dcpx_flatten_types *t; /* borrowed from the module state */
    PyObject *flat;        /* owned: fqn -> value */
    PyObject *mappings;    /* owned: fqn -> OBJ_PATH */
    PyObject *dot;         /* owned: "." */
    int depth;
    int fallback; /* set with no exception: hand the state dict to torch */
} walk_ctx;

static int walk_mapping(walk_ctx *c, PyObject *m, int kind, PyObject *path,
                        PyObject *prefix);

/* One more nesting level.  -1 with c->fallback set (no exception) past
 * MAX_DEPTH or on a RecursionError, -1 with an exception otherwise. */
static int enter(walk_ctx *c)
{
    if (c->depth >= MAX_DEPTH) {
        c->fallback = 1;
        return -1;
    }
    if (Py_EnterRecursiveCall(" while flattening a state dict")) {
        if (PyErr_ExceptionMatches(PyExc_RecursionError)) {
            PyErr_Clear();
            c->fallback = 1;
        }
        return -1;
    }
    c->depth++;
    return 0;
}

static void leave(walk_ctx *c)
{
    c->depth--;
    Py_LeaveRecursiveCall();
}

/* The K_* kind of v, or -1 with an exception (from isinstance). */
static int classify(walk_ctx *c, PyObject *v)
{
    PyTypeObject *tp = Py_TYPE(v);
    int r;
    if (tp == &PyDict_Type)
        return K_DICT;
    if (tp == &PyList_Type)
        return K_LIST;
    if ((PyObject *)tp == c->t->tensor || (PyObject *)tp == c->t->parameter)
        return K_TENSOR;
    if (tp == &PyUnicode_Type || tp == &PyLong_Type || tp == &PyFloat_Type ||
        tp == &PyBool_Type || tp == &PyTuple_Type || tp == &PyBytes_Type ||
        v == Py_None)
        return K_LEAF;
    r = PyObject_IsInstance(v, c->t->mapping);
    if (r != 0)
        return r < 0 ? -1 : K_MAPPING;
    r = PyObject_IsInstance(v, (PyObject *)&PyList_Type);
    if (r != 0)
        return r < 0 ? -1 : K_LISTLIKE;
    return K_OTHER;
}

/* torch's keep_traversing(entry): isinstance(entry, torch.Tensor). */
static int is_tensor(walk_ctx *c, PyObject *v, int kind)
{
    if (kind == K_TENSOR)
        return 1;
    if (kind == K_OTHER)
        return PyObject_IsInstance(v, c->t->tensor);
    return 0; /* builtins, and lists: no list is also a tensor */
}

/* The next entry of a list (new reference), NULL at the end or on error
 * (then an exception is set).  An exact list (it == NULL) is read by index
 * against its current size each time, as list iterators do; anything else
 * goes through its iterator, as torch's `for` does. */
static PyObject *next_entry(PyObject *list, PyObject *it, Py_ssize_t *i)
{
    PyObject *e;
    if (it != NULL)
        return PyIter_Next(it);
    if (*i >= PyList_GET_SIZE(list))
        return NULL;
    e = PyList_GET_ITEM(list, *i);
    (*i)++;
    Py_INCREF(e);
    return e;
}

/* torch's _is_terminal for v of the given kind: 1 terminal, 0 not, -1
 * stop (exception or c->fallback). */
static int is_terminal(walk_ctx *c, PyObject *v, int kind)
{
    PyObject *it = NULL, *e;
    Py_ssize_t i = 0;
    int r = 1, k;

    if (kind == K_DICT || kind == K_MAPPING)
        return 0;
    if (kind != K_LIST && kind != K_LISTLIKE)
        return 1;
    if (enter(c) < 0)
        return -1;
    if (kind == K_LISTLIKE && (it = PyObject_GetIter(v)) == NULL)
        r = -1;
    while (r == 1 && (e = next_entry(v, it, &i)) != NULL) {
        k = classify(c, e);
        if (k < 0)
            r = -1;
        else if (k == K_DICT || k == K_MAPPING)
            r = 0;
        else if (k == K_LIST || k == K_LISTLIKE)
            r = is_terminal(c, e, k); /* 0: neither is this list */
        if (r == 1) {
            int t = is_tensor(c, e, k);
            r = t < 0 ? -1 : !t;
        }
        Py_DECREF(e);
    }
    if (r == 1 && PyErr_Occurred())
        r = -1; /* the iterator failed */
    Py_XDECREF(it);
    leave(c);
    return r;
}

/* path + (part,) */
static PyObject *tuple_append(PyObject *path, PyObject *part)
{
    Py_ssize_t n = PyTuple_GET_SIZE(path);
    PyObject *t = PyTuple_New(n + 1);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *x = PyTuple_GET_ITEM(path, j);
        Py_INCREF(x);
        PyTuple_SET_ITEM(t, j, x);
    }
    Py_INCREF(part);
    PyTuple_SET_ITEM(t, n, part);
    return t;
}

/* torch's flat_copy(path, value): one leaf. */
static int emit(walk_ctx *c, PyObject *fqn, PyObject *path, PyObject *value)
{
    Py_ssize_t n = PyDict_GET_SIZE(c->flat);
    if (PyDict_SetDefault(c->flat, fqn, value) == NULL)
        return -1;
    if (PyDict_GET_SIZE(c->flat) == n) {
        PyErr_Format(PyExc_ValueError, "duplicated flatten key %U", fqn);
        return -1;
    }
    return PyDict_SetItem(c->mappings, fqn, path);
}

/* `for i, v in enumerate(value): _traverse_obj(path + (i,), v)` for a
 * non-terminal list. */
static int walk_list(walk_ctx *c, PyObject *v, int kind, PyObject *path,
                     PyObject *prefix);

/* torch's _traverse_obj(path + (part,), value): part is str(k) or the list
 * index, prefix the parent's key and "." (NULL at the top level, where the
 * key is the part itself, as ".".join of one str returns it). */
static int walk_child(walk_ctx *c, PyObject *path, PyObject *prefix,
                      PyObject *part, PyObject *value)
{
    PyObject *cpath = NULL, *pstr = NULL, *fqn = NULL, *sub = NULL;
    int kind, r = -1, term;

    cpath = tuple_append(path, part);
    if (cpath == NULL)
        goto done;
    if (PyUnicode_CheckExact(part)) {
        Py_INCREF(part);
        pstr = part;
    }
    else if ((pstr = PyObject_Str(part)) == NULL) /* an int index */
        goto done;
    if (prefix == NULL) {
        Py_INCREF(pstr);
        fqn = pstr;
    }
    else if ((fqn = PyUnicode_Concat(prefix, pstr)) == NULL)
        goto done;
    if ((kind = classify(c, value)) < 0)
        goto done;
    term = is_terminal(c, value, kind);
    if (term == 1) {
        r = emit(c, fqn, cpath, value);
        goto done;
    }
    if (term < 0 || (sub = PyUnicode_Concat(fqn, c->dot)) == NULL)
        goto done;
    if (kind == K_DICT || kind == K_MAPPING)
        r = walk_mapping(c, value, kind, cpath, sub);
    else
        r = walk_list(c, value, kind, cpath, sub);
done:
    Py_XDECREF(cpath);
    Py_XDECREF(pstr);
    Py_XDECREF(fqn);
    Py_XDECREF(sub);
    return r;
}

static int walk_list(walk_ctx *c, PyObject *v, int kind, PyObject *path,
                     PyObject *prefix)
{
    PyObject *it = NULL, *e, *idx;
    Py_ssize_t i = 0, n = 0;
    int r = 0;

    if (enter(c) < 0)
        return -1;
    if (kind == K_LISTLIKE && (it = PyObject_GetIter(v)) == NULL)
        r = -1;
    while (r == 0 && (e = next_entry(v, it, &i)) != NULL) {
        idx = PyLong_FromSsize_t(n++);
        r = idx == NULL ? -1 : walk_child(c, path, prefix, idx, e);
        Py_XDECREF(idx);
        Py_DECREF(e);
    }
    if (r == 0 && PyErr_Occurred())
        r = -1;
    Py_XDECREF(it);
    leave(c);
    return r;
}

/* str(k) as a path part, or NULL with an exception or c->fallback set
 * (a __str__ returning a str subclass: torch would str() it again for
 * every key joined below it). */
static PyObject *key_part(walk_ctx *c, PyObject *k)
{
    PyObject *s;
    if (PyUnicode_CheckExact(k)) {
        Py_INCREF(k);
        return k;
    }
    s = PyObject_Str(k);
    if (s != NULL && !PyUnicode_CheckExact(s)) {
        Py_DECREF(s);
        c->fallback = 1;
        return NULL;
    }
    return s;
}

static int walk_pair(walk_ctx *c, PyObject *path, PyObject *prefix,
                     PyObject *k, PyObject *v)
{
    PyObject *part = key_part(c, k);
    int r;
    if (part == NULL)
        return -1;
    r = walk_child(c, path, prefix, part, v);
    Py_DECREF(part);
    return r;
}

/* An exact dict, by PyDict_Next; a dict changed while walking raises what
 * dict iteration raises (its iterator counts the entries left, too). */
static int walk_dict(walk_ctx *c, PyObject *d, PyObject *path,
                     PyObject *prefix)
{
    Py_ssize_t pos = 0, n = PyDict_GET_SIZE(d), left = n;
    PyObject *k, *v;
    int r;

    while (PyDict_Next(d, &pos, &k, &v)) {
        if (left-- == 0) {
            PyErr_SetString(PyExc_RuntimeError,
                            "dictionary keys changed during iteration");
            return -1;
        }
        /* The walk may run Python code that drops the dict's references. */
        Py_INCREF(k);
        Py_INCREF(v);
        r = walk_pair(c, path, prefix, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (r < 0)
            return -1;
        if (PyDict_GET_SIZE(d) != n) {
            PyErr_SetString(PyExc_RuntimeError,
                            "dictionary changed size during iteration");
            return -1;
        }
    }
    return 0;
}

/* Any other object: `for k, v in m.items()`. */
static int walk_items(walk_ctx *c, PyObject *m, PyObject *path,
                      PyObject *prefix)
{
    PyObject *items, *it, *item;
    int r = 0;

    items = PyObject_CallMethod(m, "items", NULL);
    if (items == NULL)
        return -1;
    it = PyObject_GetIter(items);
    Py_DECREF(items);
    if (it == NULL)
        return -1;
    while (r == 0 && (item = PyIter_Next(it)) != NULL) {
        if (PyTuple_CheckExact(item) && PyTuple_GET_SIZE(item) == 2)
            r = walk_pair(c, path, prefix, PyTuple_GET_ITEM(item, 0),
                          PyTuple_GET_ITEM(item, 1));
        else {
            c->fallback = 1; /* unpacking rules: torch's own words */
            r = -1;
        }
        Py_DECREF(item);
    }
    if (r == 0 && PyErr_Occurred())
        r = -1;
    Py_DECREF(it);
    return r;
}

static int walk_mapping(walk_ctx *c, PyObject *m, int kind, PyObject *path,
                        PyObject *prefix)
{
    int r;
    if (enter(c) < 0)
        return -1;
    r = kind == K_DICT ? walk_dict(c, m, path, prefix)
                       : walk_items(c, m, path, prefix);
    leave(c);
    return r;
}

/* ------------------------------------------------------------------ */
/* The types the walk compares against, imported on first use (dcpx._C
 * itself does not import torch), and whether the exact types classified
 * by pointer still answer isinstance() as assumed.  That can change only
 * through the ABC registry (Mapping.register), whose cache token says so. */

static PyObject *import_attr(const char *module, const char *name)
{
    PyObject *m = PyImport_ImportModule(module), *a;
    if (m == NULL)
        return NULL;
    a = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return a;
}

static int load_types(dcpx_flatten_types *t)
{
    PyObject *mapping, *tensor, *parameter, *token_fn;
    if (t->mapping != NULL)
        return 0;
    mapping = import_attr("collections.abc", "Mapping");
    tensor = mapping ? import_attr("torch", "Tensor") : NULL;
    parameter = tensor ? import_attr("torch.nn", "Parameter") : NULL;
    token_fn = parameter ? import_attr("abc", "get_cache_token") : NULL;
    /* The imports may release the GIL: another thread may have won. */
    if (token_fn == NULL || t->mapping != NULL) {
        Py_XDECREF(mapping);
        Py_XDECREF(tensor);
        Py_XDECREF(parameter);
        Py_XDECREF(token_fn);
        return token_fn == NULL ? -1 : 0;
    }
    t->mapping = mapping;
    t->tensor = tensor;
    t->parameter = parameter;
    t->token_fn = token_fn;
    return 0;
}

/* 1 when isinstance(x, Mapping) is False for every exact leaf and list
 * type, and type(torch.Tensor) keeps type's __instancecheck__. */
static int check_types(dcpx_flatten_types *t)
{
    PyObject *types[] = {
        (PyObject *)&PyList_Type,    (PyObject *)&PyTuple_Type,
        (PyObject *)&PyUnicode_Type, (PyObject *)&PyLong_Type,
        (PyObject *)&PyFloat_Type,   (PyObject *)&PyBool_Type,
        (PyObject *)&PyBytes_Type,   (PyObject *)Py_TYPE(Py_None),
        t->tensor,                   t->parameter,
    };
    PyObject *a, *b;
    int r = PyObject_IsSubclass((PyObject *)&PyDict_Type, t->mapping);
    if (r != 1)
        return r;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        r = PyObject_IsSubclass(types[i], t->mapping);
        if (r != 0)
            return r < 0 ? -1 : 0;
    }
    a = PyObject_GetAttrString((PyObject *)Py_TYPE(t->tensor),
                               "__instancecheck__");
    b = a ? PyObject_GetAttrString((PyObject *)&PyType_Type,
                                   "__instancecheck__")
          : NULL;
    r = b == NULL ? -1 : a == b;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

/* 1 when the walk may run, 0 when torch's function must, -1 on error. */
static int types_ready(dcpx_flatten_types *t)
{
    PyObject *token;
    int same;
    if (load_types(t) < 0)
        return -1;
    token = PyObject_CallNoArgs(t->token_fn);
    if (token == NULL)
        return -1;
    same = t->token == NULL
               ? 0
               : PyObject_RichCompareBool(token, t->token, Py_EQ);
    if (same == 0) {
        int ok = check_types(t);
        if (ok < 0)
            same = -1;
        else {
            Py_XSETREF(t->token, token);
            token = NULL;
            t->trusted = ok;
        }
    }
    Py_XDECREF(token);
    return same < 0 ? -1 : t->trusted;
}

int dcpx_flatten_traverse(dcpx_flatten_types *t, visitproc visit, void *arg)
{
    Py_VISIT(t->mapping);
    Py_VISIT(t->tensor);
    Py_VISIT(t->parameter);
    Py_VISIT(t->token_fn);
    Py_VISIT(t->token);
    return 0;
}

void dcpx_flatten_clear(dcpx_flatten_types *t)
{
    Py_CLEAR(t->mapping);
    Py_CLEAR(t->tensor);
    Py_CLEAR(t->parameter);
    Py_CLEAR(t->token_fn);
    Py_CLEAR(t->token);
}

PyObject *dcpx_flatten_state_dict(PyObject *module, PyObject *state_dict)
{
    dcpx_state *st = PyModule_GetState(module);
    walk_ctx c = {0};
    PyObject *path = NULL, *out = NULL;
    int r;

    r = types_ready(&st->flat);
    if (r <= 0) {
        if (r < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    c.t = &st->flat;
    c.flat = PyDict_New();
    c.mappings = PyDict_New();
    c.dot = PyUnicode_FromString(".");
    path = PyTuple_New(0);
    if (c.flat == NULL || c.mappings == NULL || c.dot == NULL || path == NULL)
        goto done;
    /* torch: `for key, value in state_dict.items()` whatever its type */
    r = walk_mapping(&c, state_dict, PyDict_CheckExact(state_dict) ? K_DICT
                                                                   : K_MAPPING,
                     path, NULL);
    if (r == 0)
        out = PyTuple_Pack(2, c.flat, c.mappings);
    else if (c.fallback && !PyErr_Occurred()) {
        /* The walk stopped where it could not be sure: torch's decides. */
        Py_INCREF(Py_None);
        out = Py_None;
    }
done:
    Py_XDECREF(c.flat);
    Py_XDECREF(c.mappings);
    Py_XDECREF(c.dot);
    Py_XDECREF(path);
    return out;
}
