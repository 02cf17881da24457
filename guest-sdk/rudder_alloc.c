/* rudder_alloc.c - the guest heap (size classes over memory.grow) and the libc-free mem*.
 *
 * Blocks carry an 8-byte header {size, magic}; `size` is the whole block. Small requests
 * (block <= 32 KiB) use power-of-two classes with one free list each; larger ones are rounded
 * up to 64 KiB pages and kept on one best-fit free list. Fresh blocks are bumped from the end
 * of the heap, growing linear memory when needed. Nothing is ever returned to the host
 * (wasm memory cannot shrink). All state lives in linear memory, so a memory snapshot (the
 * host's init snapshot, a fork) copies the heap consistently.
 */
#include "rudder.h"

#define HDR 8u
#define MAGIC_USED 0x52414c31u   /* "1LAR" */
#define MAGIC_FREE 0x52414c30u
#define MIN_CLASS 4u             /* 16-byte blocks */
#define MAX_CLASS 15u            /* 32 KiB blocks */
#define PAGE 65536u

typedef struct block {
    uint32_t size;               /* whole block, header included */
    uint32_t magic;
    struct block *next;          /* on a free list only (overlaps the payload) */
} block;

extern unsigned char __heap_base;

static uintptr_t heap_top;       /* next fresh byte; 0 = not initialized yet */
static block *free_small[MAX_CLASS + 1];
static block *free_large;

static block *bump(uint32_t size) {
    if (heap_top == 0)
        heap_top = ((uintptr_t)&__heap_base + 15u) & ~(uintptr_t)15u;
    uint64_t end = (uint64_t)__builtin_wasm_memory_size(0) * PAGE;
    uint64_t want = (uint64_t)heap_top + size;
    if (want > end) {
        uint64_t pages = (want - end + PAGE - 1) / PAGE;
        if (want > 0xffffffffull || __builtin_wasm_memory_grow(0, (size_t)pages) == (size_t)-1)
            return NULL;
    }
    block *b = (block *)heap_top;
    heap_top += size;
    b->size = size;
    return b;
}

void *rudder_alloc(size_t n) {
    if (n > 0x7fff0000u)
        return NULL;
    uint32_t need = (uint32_t)n + HDR;
    block *b;
    if (need <= (1u << MAX_CLASS)) {
        uint32_t k = MIN_CLASS;
        while ((1u << k) < need)
            k++;
        b = free_small[k];
        if (b)
            free_small[k] = b->next;
        else if (!(b = bump(1u << k)))
            return NULL;
    } else {
        uint32_t size = (need + PAGE - 1) & ~(PAGE - 1);
        block **best = NULL;
        for (block **pp = &free_large; *pp; pp = &(*pp)->next)
            if ((*pp)->size >= size && (!best || (*pp)->size < (*best)->size))
                best = pp;
        if (best && (*best)->size <= 2 * size) {
            b = *best;
            *best = b->next;
        } else if (!(b = bump(size))) {
            return NULL;
        }
    }
    b->magic = MAGIC_USED;
    return (uint8_t *)b + HDR;
}

static block *header_of(void *p, const char *who) {
    block *b = (block *)((uint8_t *)p - HDR);
    if (((uintptr_t)p & 7u) || (uintptr_t)p < (uintptr_t)&__heap_base + HDR || (uintptr_t)p >= heap_top)
        rudder_panic(who);
    if (b->magic != MAGIC_USED)
        rudder_panic(b->magic == MAGIC_FREE ? "double free" : who);
    return b;
}

void rudder_free(void *p) {
    if (!p)
        return;
    block *b = header_of(p, "rudder_free: not a heap pointer");
    b->magic = MAGIC_FREE;
    if (b->size <= (1u << MAX_CLASS)) {
        uint32_t k = 31u - (uint32_t)__builtin_clz(b->size);
        b->next = free_small[k];
        free_small[k] = b;
    } else {
        b->next = free_large;
        free_large = b;
    }
}

void *rudder_realloc(void *p, size_t n) {
    if (!p)
        return rudder_alloc(n);
    block *b = header_of(p, "rudder_realloc: not a heap pointer");
    uint32_t have = b->size - HDR;
    if (n <= have)
        return p;
    void *q = rudder_alloc(n);
    if (q) {
        __builtin_memcpy(q, p, have);
        rudder_free(p);
    }
    return q;
}

void *rudder_grow(void *p, uint32_t *cap, uint32_t need, uint32_t elem) {
    if (need <= *cap)
        return p;
    uint32_t c = *cap ? *cap : 16;
    while (c < need)
        c *= 2;
    p = rudder_realloc(p, (size_t)c * elem);
    if (!p)
        rudder_panic("out of memory (growing an array)");
    *cap = c;
    return p;
}

void *rudder_zalloc(size_t n) {
    void *p = rudder_alloc(n);
    if (p)
        __builtin_memset(p, 0, n);
    return p;
}

void *rudder_xalloc(size_t n) {
    void *p = rudder_alloc(n);
    if (!p)
        rudder_panic("out of memory");
    return p;
}

/* ---- libc-free memory functions (bulk-memory instructions; no recursion into a libcall) */

void *memcpy(void *dst, const void *src, size_t n) { return __builtin_memcpy(dst, src, n); }
void *memmove(void *dst, const void *src, size_t n) { return __builtin_memmove(dst, src, n); }
void *memset(void *dst, int c, size_t n) { return __builtin_memset(dst, c, n); }

/* no_builtin: the optimizer must not turn these loops back into calls to themselves. */
__attribute__((no_builtin)) int memcmp(const void *a, const void *b, size_t n) {
    const uint8_t *x = a, *y = b;
    size_t i = 0;
    for (uint64_t u, v; i + 8 <= n; i += 8) {   /* 8 bytes at a time to the first difference (keys, masks) */
        __builtin_memcpy(&u, x + i, 8);
        __builtin_memcpy(&v, y + i, 8);
        if (u != v)
            break;
    }
    for (; i < n; i++)
        if (x[i] != y[i])
            return x[i] < y[i] ? -1 : 1;
    return 0;
}

__attribute__((no_builtin)) size_t strlen(const char *s) {
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}
