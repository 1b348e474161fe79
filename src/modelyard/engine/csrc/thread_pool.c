/* The C kernels' thread pool: a call's work is a range of items, cut into chunks that the
 * caller and the pool's threads claim one at a time. A thread the OS preempts (a server's own
 * threads share the cores) delays only the chunk it holds, never the whole call, as a static
 * split would (PyTorch's OpenMP regions wait for every thread at their end).
 *
 * The threads live across calls, spin briefly for the next one (a decode step's calls come
 * microseconds apart) and then sleep on a condition variable. One call runs at a time; a
 * second caller (another engine in the process) waits its turn.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"
#include "kernels.h"

#define MAX_THREADS 64
#define SPIN_LOOPS 8000 /* polling for the next call before a worker sleeps, while a caller
                         * holds `pool_spin`: ~0.2 ms at the ~28 ns a PAUSE takes on AMD Zen 4
                         * (a one-call decode step's calls come microseconds apart; a sleeping
                         * worker costs a wake-up). Otherwise workers sleep at once: between
                         * module-by-module calls PyTorch's own threads need the cores, and a
                         * spinning worker there cost a bfloat16 LoRA batch ~10 % of its time */
#define MAX_CHUNKS 4096  /* a call's chunk count fits the claim word's 16 bits */

#if defined(__x86_64__) || defined(__i386__)
#define PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define PAUSE() __asm__ volatile("yield")
#else
#define PAUSE() ((void)0)
#endif

typedef struct {
    pool_task task;
    const void *context;
    int64_t items, chunk;
} Call;

/* A call's chunks are claimed through one word, generation << 32 | chunks << 16 | next, so a
 * claim is valid only for the call it was read from: a late worker that finds a finished call
 * claims nothing, and one that claims a chunk holds `busy`, which the caller waits out before it
 * returns (and before the next call replaces `current`). */
static atomic_int spin_loops; /* SPIN_LOOPS while a caller holds pool_spin, else 0 */

/* on = 1: the caller's pool calls will come back to back (its own C loop): idle workers poll
 * for the next one; on = 0: they sleep as soon as idle. */
void pool_spin(int on) { atomic_store(&spin_loops, on ? SPIN_LOOPS : 0); }

static struct {
    pthread_mutex_t turn;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint_fast64_t generation; /* one per call */
    atomic_uint_fast64_t claim;
    atomic_int busy; /* threads between looking for a chunk and finishing it */
    atomic_int sleepers;
    int started; /* workers running */
    Call current;
} pool = {.turn = PTHREAD_MUTEX_INITIALIZER,
          .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

/* Claim and run chunks of the current call until none is left. */
static void work(void) {
    for (;;) {
        atomic_fetch_add(&pool.busy, 1);
        uint64_t c = atomic_load(&pool.claim);
        int claimed = 0;
        while ((c & 0xffff) < ((c >> 16) & 0xffff)) {
            if (atomic_compare_exchange_weak(&pool.claim, &c, c + 1)) {
                claimed = 1;
                break;
            }
        }
        if (claimed) {
            const Call *call = &pool.current;
            const int64_t first = (int64_t)(c & 0xffff) * call->chunk;
            const int64_t last = first + call->chunk < call->items ? first + call->chunk : call->items;
            call->task(call->context, first, last);
        }
        atomic_fetch_sub(&pool.busy, 1);
        if (!claimed) return;
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&pool.generation);
    for (;;) {
        for (int i = 0; i < atomic_load(&spin_loops) && atomic_load(&pool.generation) == seen;
             i++)
            PAUSE();
        if (atomic_load(&pool.generation) == seen) {
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.generation);
        work();
    }
    return NULL;
}

/* A child forked while the pool ran has none of its threads (and maybe a held mutex): it starts
 * over with a fresh pool. */
static void forget_pool_in_child(void) {
    pthread_mutex_init(&pool.turn, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.generation, 0);
    atomic_store(&pool.claim, 0);
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.sleepers, 0);
    pool.started = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_pool_in_child); }

static void start_workers(int n) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    while (pool.started < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&t, &attr, worker, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) return; /* fewer threads: the caller's share grows, nothing is lost */
        pool.started++;
    }
}

/* task(context, first, last) over items [0, items) in chunks of `chunk` (raised so that there
 * are at most MAX_CHUNKS), on up to `n_threads` threads, the caller's among them. */
void pool_run(pool_task task, const void *context, int64_t items, int64_t chunk, int n_threads) {
    if (items <= 0) return;
    if (chunk < 1) chunk = 1;
    if (chunk < (items + MAX_CHUNKS - 1) / MAX_CHUNKS) chunk = (items + MAX_CHUNKS - 1) / MAX_CHUNKS;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    const int64_t chunks = (items + chunk - 1) / chunk;
    if (n_threads <= 1 || chunks < 2) {
        task(context, 0, items);
        return;
    }
    pthread_mutex_lock(&pool.turn);
    start_workers(n_threads - 1);
    pool.current = (Call){task, context, items, chunk};
    const uint64_t gen = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.claim, (gen & 0xffffffffu) << 32 | (uint64_t)chunks << 16);
    atomic_store(&pool.generation, gen);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    work();
    while (atomic_load(&pool.busy) > 0) PAUSE();
    pthread_mutex_unlock(&pool.turn);
}

/* This thread's scratch of at least `floats` floats, kept for its next task (a thread runs one
 * task at a time); NULL when memory could not be had. */
float *thread_scratch(int64_t floats) {
    static __thread float *scratch = NULL;
    static __thread int64_t capacity = 0;
    if (floats > capacity) {
        free(scratch);
        scratch = malloc(sizeof(float) * (size_t)floats);
        capacity = scratch ? floats : 0;
    }
    return scratch;
}
