/* graphlm's native worker team: C threads that run the pieces of one product beside the calling
 * thread (executors/native/products.py: "small products" run products.c's kernels, "BLAS
 * products" the cblas_sgemm of the BLAS NumPy uses).
 *
 * A decode step's products are 20-300 KFLOP each, a few microseconds, and handing a piece of a
 * training step's BLAS product to the numpy executor's pool (Python threads that pass the GIL
 * between them) cost 50-100 us here, as much as the piece saved. Here a piece is handed over
 * through one atomic word per worker, which a spinning worker sees in a fraction of a microsecond:
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
void gl_cached_attention(const float *q, const float *k, const float *v, const float *ck,
                         const float *cv, float *out, float *scores, const int64_t *position,
                         int64_t r0, int64_t r1, int64_t t, int64_t d, int64_t ldq, int64_t ldk,
                         int64_t ldv, int64_t ldo, int64_t ldc, float scale);

/* one piece: PIECE_WORDS int64 words (executors/native/team.py builds the table).
 *   kind 0 / 1: gl_matmul_small / gl_matmul_small_nt:
 *       kind, a, b, out, offsets (addresses), e0, e1, m, k, lda, ldb, ldo, j0, j1
 *   kind 2 / 3: BLAS products, calls [c0, c1) of a table of cblas_sgemm calls (kind 2: the BLAS
 *       takes 64-bit integers, kind 3: 32-bit), each SGEMM_WORDS words:
 *       kind, sgemm (the BLAS's cblas_sgemm), calls (address), c0, c1
 *   a call: transa, transb, m, n, k, a, lda, b, ldb, c, ldc, accumulate (row-major, alpha 1,
 *   beta 0: the call NumPy's matmul makes for that piece, which the executor checks bit for bit
 *   once; accumulate 1: beta 1, c += the product, matmul_accumulate's later products)
 *   kind 4: gl_cached_attention's rows [r0, r1), its arguments in order (scale's float bits last):
 *       kind, q, k, v, cache_k, cache_v, out, scores, position, r0, r1, t, d, ldq, ldk, ldv, ldo,
 *       ldc, scale
 *   kind 5: one call of a kernel whose arguments are at most CALL_INTS integer-class words
 *       (pointers, int64_t, uint64_t) and at most CALL_FLOATS floats, in any order:
 *       kind, the function's address, its integer words in order (the rest 0), its floats' bits
 *       in order (the rest 0). run_call calls it through one function type of CALL_INTS words
 *       and CALL_FLOATS floats: the C calling conventions graphlm builds for (System V x86-64,
 *       AAPCS64) pass integer-class and float arguments in two separate sequences (registers,
 *       then the stack for integers past the registers, in order), so the kernel finds each of
 *       its arguments where its own type would have put it and ignores the extra ones.
 *       executors/native/team.py (`call_piece`) builds such pieces only on those platforms and only
 *       from a kernel's declared argument types. */
#define PIECE_WORDS 19
#define SGEMM_WORDS 12
#define CALL_INTS 12
#define CALL_FLOATS 4
const int64_t gl_team_words[4] = {PIECE_WORDS, SGEMM_WORDS, CALL_INTS, CALL_FLOATS};   /* read by executors/native/team.py */

void gl_sgemm_acc(int64_t sgemm, int64_t width, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
                  int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate);   /* products.c */

static void run_sgemm_calls(const int64_t *p) {
    const int64_t *calls = (const int64_t *)(intptr_t)p[2];
    for (int64_t i = p[3]; i < p[4]; i++) {
        const int64_t *c = calls + i * SGEMM_WORDS;
        gl_sgemm_acc(p[1], p[0], (int)c[0], (int)c[1], c[2], c[3], c[4], (const float *)(intptr_t)c[5], c[6],
                     (const float *)(intptr_t)c[7], c[8], (float *)(intptr_t)c[9], c[10], (int)c[11]);
    }
}

typedef void (*call_t)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, float, float, float, float);

static void run_call(const int64_t *p) {
    const int64_t *w = p + 2;   /* CALL_INTS words, then CALL_FLOATS float bits */
    float f[CALL_FLOATS];
    for (int i = 0; i < CALL_FLOATS; i++) {
        uint32_t bits = (uint32_t)w[CALL_INTS + i];
        memcpy(&f[i], &bits, 4);
    }
    ((call_t)(intptr_t)p[1])(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], w[10], w[11],
                             f[0], f[1], f[2], f[3]);
}

static void run_piece(const int64_t *p) {
    if (p[0] == 5) {
        run_call(p);
        return;
    }
    if (p[0] == 2 || p[0] == 3) {
        run_sgemm_calls(p);
        return;
    }
    if (p[0] == 4) {
        float scale;
        uint32_t bits = (uint32_t)p[18];
        memcpy(&scale, &bits, 4);
        gl_cached_attention((const float *)(intptr_t)p[1], (const float *)(intptr_t)p[2],
                            (const float *)(intptr_t)p[3], (const float *)(intptr_t)p[4],
                            (const float *)(intptr_t)p[5], (float *)(intptr_t)p[6],
                            (float *)(intptr_t)p[7], (const int64_t *)(intptr_t)p[8], p[9], p[10],
                            p[11], p[12], p[13], p[14], p[15], p[16], p[17], scale);
        return;
    }
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

/* A program's run of steps (executors/native/program.py: `StepRun`, which says why): step i is the
 * team table at steps[2i] (an address) of steps[2i + 1] pieces, run as gl_team_run runs it, the
 * steps one after the other. */
void gl_run_steps(const int64_t *steps, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        gl_team_run((const int64_t *)(intptr_t)steps[2 * i], steps[2 * i + 1]);
}
