/* The bytes malloc has handed out and not taken back, on every thread, and their most since reset. */
#include <stddef.h>
#include <malloc.h>
#include <errno.h>
extern void *__libc_malloc(size_t), *__libc_calloc(size_t, size_t), *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
static long live, most;
static void *counted(void *p) {
    if (p) {
        long now = __atomic_add_fetch(&live, (long)malloc_usable_size(p), __ATOMIC_RELAXED);
        long seen = __atomic_load_n(&most, __ATOMIC_RELAXED);
        while (now > seen && !__atomic_compare_exchange_n(&most, &seen, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    }
    return p;
}
static void uncount(void *p) { if (p) __atomic_sub_fetch(&live, (long)malloc_usable_size(p), __ATOMIC_RELAXED); }
void *malloc(size_t n) { return counted(__libc_malloc(n)); }
void *calloc(size_t k, size_t n) { return counted(__libc_calloc(k, n)); }
void *realloc(void *p, size_t n) { uncount(p); return counted(__libc_realloc(p, n)); }
void free(void *p) { uncount(p); __libc_free(p); }
void *memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
int posix_memalign(void **out, size_t a, size_t n) { void *p = counted(__libc_memalign(a, n)); if (!p) return ENOMEM; *out = p; return 0; }
long malloc_peak_live(void) { return __atomic_load_n(&live, __ATOMIC_RELAXED); }
long malloc_peak_reset(void) { long now = malloc_peak_live(); __atomic_store_n(&most, now, __ATOMIC_RELAXED); return now; }
long malloc_peak_most(void) { return __atomic_load_n(&most, __ATOMIC_RELAXED); }
