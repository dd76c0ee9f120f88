/* Vector helpers shared by the native CPU kernels (kernels/cpu_*.c): 16-float vectors in
 * GCC/Clang vector extensions (one AVX-512 register with -march=native, split by the compiler
 * elsewhere), bfloat16 conversions, and e^x for the non-positive x of a softmax or SiLU.
 * kernels/native.py hashes this file with the sources, so a change here rebuilds. */
#ifndef KVSCOPE_CPU_VEC_H
#define KVSCOPE_CPU_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int8_t v16b __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
/* Unaligned 16 floats, loaded straight into a register: a memcpy into a vector array went
 * through the stack in two halves and stalled every load that followed on store forwarding. */
typedef float v16f_u __attribute__((vector_size(64), aligned(4)));

/* 16 int8 codes as floats. GCC 12 lowers __builtin_convertvector from int8 lanes to sixteen
 * scalar conversions (it made the decode attention 3.5x slower on an int8 pool than on a
 * bfloat16 one), so x86 takes the widening instructions; other targets the portable form. */
static inline __attribute__((always_inline)) v16f i8x16_to_f32(const int8_t *src) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
#elif defined(__AVX2__)
    v8f lo = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
    v8f hi = (v8f)_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8))));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v16b b;
    memcpy(&b, src, 16);
    return __builtin_convertvector(b, v16f);
#endif
}

#if defined(__AVX2__) && defined(__F16C__)
#define KVSCOPE_HAVE_F16C 1
/* 16 float16 values (as bits) to floats, in hardware. */
static inline __attribute__((always_inline)) v16f f16x16_bits_to_f32(__m256i h) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtph_ps(h);
#else
    v8f lo = (v8f)_mm256_cvtph_ps(_mm256_castsi256_si128(h));
    v8f hi = (v8f)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* 16 float16 values to floats. */
static inline __attribute__((always_inline)) v16f f16x16_to_f32(const uint16_t *src) {
    return f16x16_bits_to_f32(_mm256_loadu_si256((const __m256i *)src));
}

/* 16 fp8 e4m3 codes as floats times 2^-8: the byte's sign, exponent and mantissa moved into
 * float16 bits are exactly the value times 2^-8, subnormals included (the Triton kernel's
 * trick); the caller folds 2^8 into its scale. The NaN code (never written: the quantizer
 * clamps to +-448) would read as +-480. */
static inline __attribute__((always_inline)) v16f fp8x16_to_f32_div256(const uint8_t *src) {
    /* sign-extended to 16 bits and shifted left by 7, exponent and mantissa sit in place and
     * the sign fills bits 15 and 14: clearing bit 14 leaves float16 bits (3 ops where masks
     * took 5) */
    __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)src));
    return f16x16_bits_to_f32(_mm256_and_si256(_mm256_slli_epi16(w, 7),
                                               _mm256_set1_epi16((short)0xBFFF)));
}

#if defined(__AVX512BW__)
/* fp8x16_to_f32_div256 for 32 codes, the integer steps done once on a 512-bit register. */
static inline __attribute__((always_inline)) void fp8x32_to_f32_div256(v16f out[2],
                                                                      const uint8_t *src) {
    __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)src));
    w = _mm512_and_si512(_mm512_slli_epi16(w, 7), _mm512_set1_epi16((short)0xBFFF));
    out[0] = f16x16_bits_to_f32(_mm512_castsi512_si256(w));
    out[1] = f16x16_bits_to_f32(_mm512_extracti64x4_epi64(w, 1));
}
#endif
#endif

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does (NaN stays NaN). */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __attribute__((always_inline)) v16f load_bf16x16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, 32);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, 64);
    return f;
}

/* f32_to_bf16 on 16 lanes (NaN is not expected here: activations). */
static inline __attribute__((always_inline)) void store_bf16x16(uint16_t *p, v16f f) {
    v16u u;
    memcpy(&u, &f, 64);
    u += 0x7fffu + ((u >> 16) & 1u);
    v16h h = __builtin_convertvector(u >> 16, v16h);
    memcpy(p, &h, 32);
}

static inline __attribute__((always_inline)) float hsum16(v16f v) {
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    v8f b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    a += b;
    v4f c = __builtin_shufflevector(a, a, 0, 1, 2, 3), e = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    c += e;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* 2^f for f in [0, 1), by a degree-6 polynomial in Horner form, for a float or a v16f f. */
#define EXP2_FRACTION(f)                                                                   \
    ((((((1.535336188319500e-4f * (f) + 1.339887440266574e-3f) * (f)                       \
         + 9.618437357674640e-3f) * (f) + 5.550332471162809e-2f) * (f)                     \
       + 2.402264791363012e-1f) * (f) + 6.931472028550421e-1f) * (f) + 1.0f)

/* e^x for x <= 0 (softmax after subtracting the max, SiLU of -|x|), without libm:
 * 2^(x log2 e) split into 2^n (built in the exponent bits)
 * times 2^f, f in [0, 1), by a degree-6 polynomial; relative error about 2e-7, a float32
 * rounding or two. Below -87, e^x is under float's smallest normal: 0. */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = floorf(t), f = t - n;
    float p = EXP2_FRACTION(f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* exp_nonpositive, 16 at a time. */
static inline __attribute__((always_inline)) v16f exp_nonpositive16(v16f x) {
    const v16f lo = (v16f){0} - 87.0f;
    v16i below = x < lo;
    x = (v16f)(((v16i)x & ~below) | ((v16i)lo & below));
    v16f t = x * 1.44269504088896341f;
    v16i n = __builtin_convertvector(t, v16i);  /* toward zero; t <= 0, so one above floor */
    n += (v16i)(__builtin_convertvector(n, v16f) > t);  /* true is -1 */
    v16f f = t - __builtin_convertvector(n, v16f);
    v16f p = EXP2_FRACTION(f);
    return p * (v16f)((n + 127) << 23);
}

#endif
