/* graphlm's native worker team: C threads that run the pieces of one small product beside the
 * calling thread (executors/native.py, "small products"; the kernels are native_kernels.c's).
 *
 * A decode step's products are 20-300 KFLOP each, a few microseconds: the numpy executor's pool
 * (Python threads that hand the GIL over) costs more per piece than such a product takes, so they
 * ran on one thread and a second core sat idle. Here a piece is handed over through one atomic
 * word per worker, which a spinning worker sees within a fraction of a microsecond:
 *
 *   gl_team_run(pieces, count): piece 0 on the calling thread, piece i on worker i-1, and back
 *   when all are done. A piece is claimed by whoever takes it first (state POSTED -> CLAIMED by
 *   compare-and-swap): the caller, done with its own piece, takes any piece no worker has taken
 *   yet, so a sleeping worker never holds the caller up by its wake-up time.
 *
 * Workers spin for SPIN_NS after their last piece, then sleep on a condition variable (woken by
 * the next post). They start on first use (as many as the widest call needs) and live until the
 * process ends; a forked child starts its own. A second caller while one holds the team (two
 * user threads running programs at once) runs its pieces itself, one after the other: the same
 * pieces, so the same results. Every piece computes what it computes alone (the kernels' bits do
 * not depend on the cut), so results do not depend on which thread ran which piece.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

void gl_matmul_small(const float *a, const float *b, float *o, const int64_t *offsets, int64_t e0,
                     int64_t e1, int64_t m, int64_t k, int64_t lda, int64_t ldb, int64_t ldo,
                     int64_t j0, int64_t j1);
void gl_matmul_small_nt(const float *a, const float *bt, float *o, const int64_t *offsets,
                        int64_t e0, int64_t e1, int64_t m, int64_t k, int64_t lda, int64_t ldb,
                        int64_t ldo, int64_t j0, int64_t j1);

/* one piece: PIECE_WORDS int64 words (executors/native.py builds the table):
 *   kind (0: gl_matmul_small, 1: gl_matmul_small_nt), a, b, out, offsets (addresses),
 *   e0, e1, m, k, lda, ldb, ldo, j0, j1 */
#define PIECE_WORDS 14

static void run_piece(const int64_t *p) {
    const float *a = (const float *)(intptr_t)p[1], *b = (const float *)(intptr_t)p[2];
    float *o = (float *)(intptr_t)p[3];
    const int64_t *offsets = (const int64_t *)(intptr_t)p[4];
    if (p[0] == 1)
        gl_matmul_small_nt(a, b, o, offsets, p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13]);
    else
        gl_matmul_small(a, b, o, offsets, p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13]);
}

#define TEAM_MAX 63            /* workers at most (a call of more pieces runs the rest itself) */
#define SPIN_NS 300000         /* a worker polls this long for its next piece before it sleeps */

enum { EMPTY, POSTED, CLAIMED, DONE };

typedef struct {
    _Atomic int state;         /* EMPTY -> POSTED (caller) -> CLAIMED (worker or caller) -> DONE */
    _Atomic int sleeping;      /* the worker waits on `wake` (the caller then signals) */
    const int64_t *piece;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    char pad[64];              /* (workers' words on their own cache lines) */
} worker_t;

static worker_t workers[TEAM_MAX];
static int started;            /* workers running in this process */
static pthread_mutex_t team_lock = PTHREAD_MUTEX_INITIALIZER;   /* one caller at a time */
static int fork_handler_set;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* take a posted piece (worker or caller): 1 when this thread is to run it */
static inline int claim(worker_t *w) {
    int expected = POSTED;
    return atomic_compare_exchange_strong(&w->state, &expected, CLAIMED);
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    for (;;) {
        int64_t deadline = now_ns() + SPIN_NS;
        for (int spins = 0; atomic_load_explicit(&w->state, memory_order_acquire) != POSTED; spins++) {
            cpu_relax();
            if ((spins & 255) == 255 && now_ns() > deadline) {   /* sleep until the next post */
                pthread_mutex_lock(&w->lock);
                atomic_store(&w->sleeping, 1);
                while (atomic_load(&w->state) != POSTED)
                    pthread_cond_wait(&w->wake, &w->lock);
                atomic_store(&w->sleeping, 0);
                pthread_mutex_unlock(&w->lock);
                break;
            }
        }
        if (claim(w)) {
            run_piece(w->piece);
            atomic_store_explicit(&w->state, DONE, memory_order_release);
        }
    }
    return NULL;
}

static void team_after_fork(void) {   /* the child has none of the parent's workers */
    started = 0;
    pthread_mutex_init(&team_lock, NULL);
}

/* make sure `n` workers run; returns how many of them do (fewer if a thread could not start) */
static int start_workers(int n) {
    if (!fork_handler_set) {
        pthread_atfork(NULL, NULL, team_after_fork);
        fork_handler_set = 1;
    }
    if (n > TEAM_MAX) n = TEAM_MAX;
    while (started < n) {
        worker_t *w = &workers[started];
        memset(w, 0, sizeof *w);
        pthread_mutex_init(&w->lock, NULL);
        pthread_cond_init(&w->wake, NULL);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t thread;
        int failed = pthread_create(&thread, &attr, worker_main, w);
        pthread_attr_destroy(&attr);
        if (failed) break;
        started++;
    }
    return started < n ? started : n;
}

/* run the `count` pieces of `pieces` (count x PIECE_WORDS) and return when all are done */
void gl_team_run(const int64_t *pieces, int64_t count) {
    if (count <= 1 || pthread_mutex_trylock(&team_lock) != 0) {   /* alone, or the team is busy */
        for (int64_t i = 0; i < count; i++) run_piece(pieces + i * PIECE_WORDS);
        return;
    }
    int helpers = start_workers((int)(count - 1));
    for (int i = 0; i < helpers; i++) {
        worker_t *w = &workers[i];
        w->piece = pieces + (i + 1) * PIECE_WORDS;
        atomic_store(&w->state, POSTED);   /* (seq_cst: ordered before the load of sleeping) */
        if (atomic_load(&w->sleeping)) {
            pthread_mutex_lock(&w->lock);
            pthread_cond_signal(&w->wake);
            pthread_mutex_unlock(&w->lock);
        }
    }
    run_piece(pieces);
    for (int64_t i = helpers + 1; i < count; i++) run_piece(pieces + i * PIECE_WORDS);
    for (int i = 0; i < helpers; i++) {   /* take what no worker took; wait for the rest */
        worker_t *w = &workers[i];
        if (claim(w))
            run_piece(w->piece);
        else
            while (atomic_load_explicit(&w->state, memory_order_acquire) != DONE) cpu_relax();
        atomic_store_explicit(&w->state, EMPTY, memory_order_relaxed);
    }
    pthread_mutex_unlock(&team_lock);
}
