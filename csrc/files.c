/* Opening the files of a checkpoint directory.
 *
 * A checkpoint directory may hold anything where dcpx expects a data file
 * or `.metadata`: a FIFO (open() and read() would block forever), a
 * symbolic link to a file elsewhere (reading it loads someone else's
 * bytes; writing through it overwrites them), a directory.  So:
 *
 * - reads open with O_NOFOLLOW | O_NONBLOCK (a link is refused, a FIFO
 *   opens at once), then fstat must say S_ISREG, then O_NONBLOCK is
 *   cleared again;
 * - writes remove whatever has the name (a link itself, never its target;
 *   a FIFO without opening it) and create a fresh file with O_EXCL, which
 *   never follows a link.  Data files always have names no committed
 *   `.metadata` refers to (docs/format.md, Commit), so removing a stale
 *   one loses nothing that O_TRUNC would not have destroyed too.
 *
 * The checkpoint directory itself may be a link (`latest -> step_100`):
 * only the last component of a path is checked.  Called without the GIL.
 */
#include "dcpx.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *special_kind(mode_t mode)
{
    switch (mode & S_IFMT) {
    case S_IFLNK:
        return "is a symbolic link (dcpx follows no links inside a "
               "checkpoint directory; refused)";
    case S_IFIFO:
        return "is a FIFO, not a regular file (refused)";
    case S_IFDIR:
        return "is a directory, not a regular file (refused)";
    case S_IFSOCK:
        return "is a socket, not a regular file (refused)";
    case S_IFCHR:
        return "is a character device, not a regular file (refused)";
    case S_IFBLK:
        return "is a block device, not a regular file (refused)";
    default:
        return "is not a regular file (refused)";
    }
}

int dcpx_open_regular(const char *path, const char **why)
{
    struct stat st;
    int fd, fl, err;

    *why = NULL;
    fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        /* ELOOP: a link; ENXIO: a socket.  Say which, keep errno. */
        err = errno;
        if (lstat(path, &st) == 0 && !S_ISREG(st.st_mode))
            *why = special_kind(st.st_mode);
        errno = err;
        return -1;
    }
    if (fstat(fd, &st) < 0)
        goto fail;
    if (!S_ISREG(st.st_mode)) {
        *why = special_kind(st.st_mode);
        errno = EINVAL;
        goto fail;
    }
    fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0)
        goto fail;
    return fd;
fail:
    err = errno;
    close(fd);
    errno = err;
    return -1;
}

int dcpx_create_fresh(const char *path)
{
    if (unlink(path) < 0 && errno != ENOENT)
        return -1; /* EISDIR for a directory: reported naming the file */
    return open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                0644);
}
