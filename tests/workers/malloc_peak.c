/* The bytes torch's CPU allocator holds on every thread, and their most since reset: a preloaded malloc that counts
   the blocks allocated from the code range malloc_peak_count_from names (libc10's alloc_cpu), until they are freed
   wherever that is, so that what oneDNN, gloo or Python allocate for themselves is left out. */
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
#include <stdint.h>
extern void *__libc_malloc(size_t), *__libc_calloc(size_t, size_t), *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
static long live, most;
static uintptr_t lo, hi;
#define FROM_TORCH ((uintptr_t)__builtin_return_address(0) - lo < hi - lo)
#define SLOTS (1 << 20) /* the counted blocks: an open-addressed set of addresses (1: a freed slot) */
static uintptr_t slots[SLOTS];
static int lock;
static uintptr_t *slot(uintptr_t p, int to_add) {
    uintptr_t *freed = 0;
    for (size_t i = (p >> 6) * 0x9E3779B97F4A7C15u >> 44;; i = (i + 1) & (SLOTS - 1)) {
        if (slots[i] == p) return &slots[i];
        if (slots[i] == 1 && !freed) freed = &slots[i];
        if (slots[i] == 0) return to_add ? (freed ? freed : &slots[i]) : 0;
    }
}
static int take(uintptr_t p, int to_add) { /* add p to the set, or remove it: whether it was counted */
    while (__atomic_exchange_n(&lock, 1, __ATOMIC_ACQUIRE)) {}
    uintptr_t *s = slot(p, to_add);
    int found = s && *s == p;
    if (s) *s = to_add ? p : 1;
    __atomic_store_n(&lock, 0, __ATOMIC_RELEASE);
    return found;
}
static void *counted(void *p, int torch) {
    if (p && torch) {
        take((uintptr_t)p, 1);
        long now = __atomic_add_fetch(&live, (long)malloc_usable_size(p), __ATOMIC_RELAXED);
        long seen = __atomic_load_n(&most, __ATOMIC_RELAXED);
        while (now > seen && !__atomic_compare_exchange_n(&most, &seen, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    }
    return p;
}
void *malloc(size_t n) { return counted(__libc_malloc(n), FROM_TORCH); }
void *calloc(size_t k, size_t n) { return counted(__libc_calloc(k, n), FROM_TORCH); }
void *memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n), FROM_TORCH); }
void *aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n), FROM_TORCH); }
int posix_memalign(void **out, size_t a, size_t n) {
    void *p = counted(__libc_memalign(a, n), FROM_TORCH);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}
void free(void *p) {
    if (p && take((uintptr_t)p, 0)) __atomic_sub_fetch(&live, (long)malloc_usable_size(p), __ATOMIC_RELAXED);
    __libc_free(p);
}
void *realloc(void *p, size_t n) {  /* (torch's allocator does not realloc) */
    return __libc_realloc(p, n);
}
void malloc_peak_count_from(uintptr_t start, uintptr_t end) { lo = start, hi = end; }
long malloc_peak_live(void) { return __atomic_load_n(&live, __ATOMIC_RELAXED); }
long malloc_peak_most(void) { return __atomic_load_n(&most, __ATOMIC_RELAXED); }
long malloc_peak_reset(void) {
    long now = malloc_peak_live();
    __atomic_store_n(&most, now, __ATOMIC_RELAXED);
    return now;
}
