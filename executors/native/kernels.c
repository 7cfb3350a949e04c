/* graphlm's native kernels: the float32 loops behind executors/native/.
 *
 * Each function is one fused pass (or one pass per row) over contiguous float32 memory that the
 * executor planned: no allocation, no threads (the executor cuts the work into ranges and runs
 * them on its own threads; ctypes releases the GIL for the call), no global state but the
 * attention's two per-thread packing buffers (plan_product), scratch that no call reads after.
 *
 * Compiled on first use by executors/native/build.py with the machine's C compiler:
 *     cc -O3 -march=native -ffp-contract=off -fno-math-errno -fPIC -shared
 * -ffp-contract=off keeps every `a*b + c` written here as two roundings, so the kernels that do
 * not call exp_f32 or sum a row (dropout, AdamW, the attention gradient's ds) compute exactly
 * what the numpy executor computes; exp_f32's polynomial asks for fused multiply-adds by name.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __FMA__
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#define LANES 16   /* partial sums per row reduction (two AVX registers of 8 floats) */

static inline float bits_to_float(uint32_t i) { float f; memcpy(&f, &i, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t i; memcpy(&i, &f, 4); return i; }

/* exp(x) in float32, within 2 ulp (Cephes' expf: x = n*ln2 + r, |r| <= ln2/2, a degree-6
 * polynomial for e^r, then 2^n put in the exponent bits). Branch-free, so the compiler
 * vectorises the loops that call it. Above EXP_HI the result is +inf (true exp overflows a
 * little later, at 88.72); below EXP_LO (ln of the smallest normal float) it is 0 (NumPy
 * returns subnormals there); NaN gives NaN. */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504019f
static inline float exp_f32(float x) {
    float c = x > EXP_HI ? EXP_HI : x;
    c = c < EXP_LO ? EXP_LO : c;
    float t = MADD(c, 1.44269504088896341f, 12582912.0f);   /* n in t's low mantissa bits */
    float n = t - 12582912.0f;
    float r = MADD(n, -0.693359375f, c);
    r = MADD(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = MADD(p, r, 1.3981999507e-3f);
    p = MADD(p, r, 8.3334519073e-3f);
    p = MADD(p, r, 4.1665795894e-2f);
    p = MADD(p, r, 1.6666665459e-1f);
    p = MADD(p, r, 5.0000001201e-1f);
    p = MADD(p, r * r, r) + 1.0f;
    uint32_t e = (float_to_bits(t) - 0x4B400000u + 127u) << 23;   /* 2^n, n in [-126, 127] */
    float y = p * bits_to_float(e);
    y = x > EXP_HI ? INFINITY : y;
    y = x < EXP_LO ? 0.0f : y;
    return y;
}

static inline float row_sum(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += x[i];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

static inline float row_dot(const float *x, const float *y, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * y[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += x[i] * y[i];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

static inline float row_max(const float *x, int64_t n) {
    float acc[LANES];
    for (int j = 0; j < LANES; j++) acc[j] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
    float m = -INFINITY;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    for (int j = 0; j < LANES; j++) m = acc[j] > m ? acc[j] : m;
    return m;
}

/* ---- elementwise ------------------------------------------------------------------------ */

void gl_exp(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = exp_f32(x[i]);
}

/* tanh GELU: s = 1 / (exp((x*x*a + b)*x) + 1), y = x*s (graphlm.ops' GELU note); s kept when
 * `keep` is not NULL, for the backward. */
void gl_gelu_tanh(const float *x, float *y, float *keep, int64_t n, float a, float b) {
    if (keep) {
        for (int64_t i = 0; i < n; i++) {
            float xi = x[i];
            float s = 1.0f / (exp_f32((xi * xi * a + b) * xi) + 1.0f);
            keep[i] = s;
            y[i] = xi * s;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float xi = x[i];
            y[i] = xi * (1.0f / (exp_f32((xi * xi * a + b) * xi) + 1.0f));   /* x*s, not x/(e + 1) */
        }
    }
}

/* The tanh GELU's sigmoid alone: s = 1/(exp((x*x*a + b)*x) + 1), as gl_gelu_tanh keeps it. */
void gl_gelu_tanh_sigmoid(const float *x, float *s, int64_t n, float a, float b) {
    for (int64_t i = 0; i < n; i++) {
        float xi = x[i];
        s[i] = 1.0f / (exp_f32((xi * xi * a + b) * xi) + 1.0f);
    }
}

/* tanh GELU's input gradient: out = g*(s + (1 - s)*s*x*(x*x*da + db)), from the forward's
 * kept s, or with s recomputed (constants a, b) when `kept` is NULL. */
void gl_gelu_tanh_backward(const float *x, const float *g, const float *kept, float *out, int64_t n,
                           float a, float b, float da, float db) {
    if (kept) {
        for (int64_t i = 0; i < n; i++) {
            float xi = x[i], s = kept[i];
            out[i] = g[i] * ((1.0f - s) * s * xi * (xi * xi * da + db) + s);
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float xi = x[i];
            float s = 1.0f / (exp_f32((xi * xi * a + b) * xi) + 1.0f);
            out[i] = g[i] * ((1.0f - s) * s * xi * (xi * xi * da + db) + s);
        }
    }
}

/* Softmax of each row of `cols` floats: y = exp(x - rowmax) / rowsum (y may be x). */
void gl_softmax_rows(const float *x, float *y, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *yr = y + r * cols;
        float mx = row_max(xr, cols);
        for (int64_t i = 0; i < cols; i++) yr[i] = exp_f32(xr[i] - mx);
        float s = row_sum(yr, cols);
        for (int64_t i = 0; i < cols; i++) yr[i] = yr[i] / s;
    }
}

/* ---- memory-bound ops: binary add and multiply, sums over outer axes, strided copies --------
 * Each is NumPy's own arithmetic in NumPy's order (one rounding per element; a sum in row order),
 * so these give the numpy executor's bits; what they save is NumPy's per-call and per-inner-loop
 * overhead, and on n threads they run as n calls on the C worker team. */

/* rows [r0, r1) of out = x op y, x and out [rows, cols], y's row for row i: (i / rpy) % ny (a
 * full-shape y: rpy 1, ny rows; a row vector: ny 1; y [G, 1, cols] against x [G, R, cols]:
 * rpy R, ny G). op 0: x + y, 1: x * y. out may be x (in place). */
void gl_binary_rows(const float *x, const float *y, float *out, int64_t r0, int64_t r1, int64_t cols,
                    int64_t rpy, int64_t ny, int64_t op) {
    for (int64_t i = r0; i < r1; i++) {
        const float *xi = x + i * cols, *yi = y + ((i / rpy) % ny) * cols;
        float *oi = out + i * cols;
        if (op == 0)
            for (int64_t j = 0; j < cols; j++) oi[j] = xi[j] + yi[j];
        else
            for (int64_t j = 0; j < cols; j++) oi[j] = xi[j] * yi[j];
    }
}

#define SUM_BLOCK 512   /* columns summed together: their partial sums stay in L1 */

/* columns [j0, j1) of out[g][j] = ((0 + x[g][0][j]) + x[g][1][j]) + ... + x[g][R-1][j], x
 * [G, R, C] contiguous: NumPy's add.reduce over the middle axis (it starts from its identity 0,
 * so -0 sums to +0, and adds the rows in order). */
void gl_sum_rows(const float *x, float *out, int64_t groups, int64_t rows, int64_t cols, int64_t j0, int64_t j1) {
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * rows * cols;
        float *og = out + g * cols;
        for (int64_t b0 = j0; b0 < j1; b0 += SUM_BLOCK) {
            int64_t b1 = j1 - b0 < SUM_BLOCK ? j1 : b0 + SUM_BLOCK;
            for (int64_t j = b0; j < b1; j++) og[j] = 0.0f;
            for (int64_t i = 0; i < rows; i++) {
                const float *xr = xg + i * cols;
                for (int64_t j = b0; j < b1; j++) og[j] += xr[j];
            }
        }
    }
}

/* rows [r0, r1) of dst = src (+ 0.0f where plus_zero: -0 becomes +0, as NumPy's copy by adding
 * zero), dst contiguous [n0, n1, n2, n3], src the same shape at element strides s0, s1, s2 with
 * rows of n3 contiguous floats; row r is (r / (n1 n2), (r / n2) % n1, r % n2). */
void gl_copy_rows(const float *src, float *dst, int64_t r0, int64_t r1, int64_t n1, int64_t n2, int64_t n3,
                  int64_t s0, int64_t s1, int64_t s2, int64_t plus_zero) {
    if (r0 >= r1 || n1 <= 0 || n2 <= 0) return;
    int64_t i0 = r0 / (n1 * n2), i1 = (r0 / n2) % n1, i2 = r0 % n2;
    for (int64_t r = r0; r < r1; r++) {
        const float *s = src + i0 * s0 + i1 * s1 + i2 * s2;
        float *d = dst + r * n3;
        if (plus_zero)
            for (int64_t j = 0; j < n3; j++) d[j] = s[j] + 0.0f;
        else
            memcpy(d, s, (size_t)n3 * sizeof(float));
        if (++i2 == n2) {
            i2 = 0;
            if (++i1 == n1) { i1 = 0; i0++; }
        }
    }
}

/* ---- layer norm (rows of `cols` floats) ------------------------------------------------- */

/* y = (x - mean) / sqrt(mean((x - mean)^2) + eps) * w + b per row (w, b may be NULL). Kept for
 * the backward when not NULL: xc = x - mean, sv = the row's sqrt(var + eps), xhat = xc / sv. */
void gl_layer_norm(const float *x, const float *w, const float *b, float *y, float *xc_keep,
                   float *sv_keep, float *xhat_keep, int64_t rows, int64_t cols, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *yr = y + r * cols;
        float *xc = xc_keep ? xc_keep + r * cols : yr;
        float mean = row_sum(xr, cols) / (float)cols;
        for (int64_t i = 0; i < cols; i++) xc[i] = xr[i] - mean;
        float sv = sqrtf(row_dot(xc, xc, cols) / (float)cols + eps);
        if (sv_keep) sv_keep[r] = sv;
        float *xh = xhat_keep ? xhat_keep + r * cols : yr;
        for (int64_t i = 0; i < cols; i++) xh[i] = xc[i] / sv;
        if (w && b) {
            for (int64_t i = 0; i < cols; i++) yr[i] = xh[i] * w[i] + b[i];
        } else if (w) {
            for (int64_t i = 0; i < cols; i++) yr[i] = xh[i] * w[i];
        } else if (b) {
            for (int64_t i = 0; i < cols; i++) yr[i] = xh[i] + b[i];
        } else if (xh != yr) {
            memcpy(yr, xh, (size_t)cols * sizeof(float));
        }
    }
}

/* Layer norm's input gradient: out = r*(gh - mean(gh) - xhat*mean(gh*xhat)), gh = g*w (or g),
 * r = 1/sv, xhat = xc*r. From the forward's kept xc and sv; when `sv` is NULL, `xc` is x and
 * both are recomputed (eps used only then). */
void gl_layer_norm_backward(const float *xc, const float *sv, const float *g, const float *w,
                            float *out, int64_t rows, int64_t cols, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *cr = xc + r * cols, *gr = g + r * cols;
        float *o = out + r * cols;
        float rr;
        if (sv) {
            rr = 1.0f / sv[r];
        } else {
            float mean = row_sum(cr, cols) / (float)cols;
            for (int64_t i = 0; i < cols; i++) o[i] = cr[i] - mean;   /* o holds xc meanwhile */
            rr = 1.0f / sqrtf(row_dot(o, o, cols) / (float)cols + eps);
            cr = o;
        }
        float acc1[LANES] = {0}, acc2[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= cols; i += LANES)
            for (int j = 0; j < LANES; j++) {
                float gh = w ? gr[i + j] * w[i + j] : gr[i + j];
                acc1[j] += gh;
                acc2[j] += gh * (cr[i + j] * rr);
            }
        float m1 = 0.0f, m2 = 0.0f;
        for (; i < cols; i++) {
            float gh = w ? gr[i] * w[i] : gr[i];
            m1 += gh;
            m2 += gh * (cr[i] * rr);
        }
        for (int j = 0; j < LANES; j++) { m1 += acc1[j]; m2 += acc2[j]; }
        m1 /= (float)cols;
        m2 /= (float)cols;
        for (i = 0; i < cols; i++) {
            float gh = w ? gr[i] * w[i] : gr[i];
            o[i] = rr * (gh - m1 - (cr[i] * rr) * m2);
        }
    }
}

/* ---- causal attention's softmax (numpy_executor.py, "causal attention") ------------------ */

/* One query block of `nmat` score matrices, each `rows` x `cols` and contiguous, row i being
 * query r0 + i: E = exp(s - rowmax) over the keys [0, r0 + i], 0 above the diagonal, in place;
 * l[m*l_stride + i] = rowsum(E). */
void gl_causal_softmax_block(float *s, float *l, int64_t nmat, int64_t rows, int64_t cols,
                             int64_t r0, int64_t l_stride) {
    for (int64_t m = 0; m < nmat; m++) {
        for (int64_t i = 0; i < rows; i++) {
            float *x = s + (m * rows + i) * cols;
            int64_t valid = r0 + i + 1 < cols ? r0 + i + 1 : cols;
            float mx = row_max(x, valid);
            for (int64_t j = 0; j < valid; j++) x[j] = exp_f32(x[j] - mx);
            for (int64_t j = valid; j < cols; j++) x[j] = 0.0f;
            l[m * l_stride + i] = row_sum(x, valid);
        }
    }
}

/* The softmax gradient's ds = (s - dd) * E over one query block, in place in s (dd one value
 * per row, at dd[m*dd_stride + i]): the numpy kernel's two passes, rounded the same way. */
void gl_softmax_ds_block(float *s, const float *e, const float *dd, int64_t nmat, int64_t rows,
                         int64_t cols, int64_t dd_stride) {
    for (int64_t m = 0; m < nmat; m++) {
        for (int64_t i = 0; i < rows; i++) {
            float *x = s + (m * rows + i) * cols;
            const float *er = e + (m * rows + i) * cols;
            float d = dd[m * dd_stride + i];
            for (int64_t j = 0; j < cols; j++) x[j] = (x[j] - d) * er[j];
        }
    }
}

/* ---- causal attention whole in C: the numpy kernel's steps, its products as BLAS calls -------- */

/* The numpy attention kernels (executors/numpy/attention.py) run Python between their BLAS calls
 * and steps, so on n threads their pieces queue for the GIL. These run the same steps for score
 * matrices [m0, m1) with the products as cblas_sgemm calls of the BLAS NumPy uses (its address in
 * the plan), one matrix after the other, each computed the same way whatever the range or thread.
 *
 * plan (int64 words, built once per node by executors/native/attention.py): t, d, M (matrices of the node),
 * nb (query blocks), the sgemm's address and integer width (2: 64-bit, 3: 32-bit, as
 * team.c's piece kinds), whether the products run in C (plan_product), the row strides (floats) of q, k, v and g, the address of a
 * table of 4 element offsets per matrix (of q, k, v, g), the addresses of the node's arrays
 * (PLAN_ARRAYS words, in the order each kernel names), then the nb + 1 query block bounds.
 * Arrays other than q, k, v and g hold their matrices contiguously, matrix after matrix. Block b
 * of matrix m of a score buffer (E, ds) is (r1 - r0) x r1 floats at M * (the sizes of the blocks
 * before b) + m * (r1 - r0) * r1 (graphlm.ops.causal_attention_keep_layout). */
enum { P_T, P_D, P_M, P_NB, P_SGEMM, P_KIND, P_OWN, P_LD, P_OFFSETS = P_LD + 4, P_ARRAYS, PLAN_ARRAYS = 12,
       P_BOUNDS = P_ARRAYS + PLAN_ARRAYS };
const int64_t gl_attention_plan_arrays = PLAN_ARRAYS;   /* read by executors/native/attention.py */
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO = 111, CBLAS_T = 112 };   /* CBLAS's enum values */
typedef void (*sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                           const float *, int64_t, float, float *, int64_t);
typedef void (*sgemm32_fn)(int, int, int, int32_t, int32_t, int32_t, float, const float *, int32_t,
                           const float *, int32_t, float, float *, int32_t);

/* c = op(a) @ op(b) by the cblas_sgemm at `sgemm` (op(a) m x k, op(b) k x n; row-major, alpha 1,
 * beta 0; ta / tb: that operand transposed); `width` 2: it takes 64-bit integers, 3: 32-bit (the
 * team's piece kinds). The one place graphlm calls a BLAS from C (team.c's BLAS pieces too). */
void gl_sgemm(int64_t sgemm, int64_t width, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
              int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc) {
    int oa = ta ? CBLAS_T : CBLAS_NO, ob = tb ? CBLAS_T : CBLAS_NO;
    if (width == 2)
        ((sgemm64_fn)(intptr_t)sgemm)(CBLAS_ROW_MAJOR, oa, ob, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
    else
        ((sgemm32_fn)(intptr_t)sgemm)(CBLAS_ROW_MAJOR, oa, ob, (int32_t)m, (int32_t)n, (int32_t)k, 1.0f,
                                      a, (int32_t)lda, b, (int32_t)ldb, 0.0f, c, (int32_t)ldc);
}

static void nn_product(const float *a, const float *b, float *o, int64_t m, int64_t k, int64_t lda, int64_t ldb,
                       int64_t ldo, int64_t j0, int64_t j1);   /* the small products' NN kernel, below */

#define PACK_FLOATS 65536   /* per thread and operand: a transposed operand of an attention product */
static _Thread_local float pack_a[PACK_FLOATS], pack_b[PACK_FLOATS];

/* x [rows, cols] at row stride ld, transposed into xt [cols, rows] (contiguous) */
static void transpose_into(const float *x, int64_t rows, int64_t cols, int64_t ld, float *xt) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) xt[j * rows + i] = x[i * ld + j];
}

/* An attention plan's product c = op(a) @ op(b) (gl_sgemm's arguments). Where the plan says so
 * (P_OWN) and a transposed operand fits PACK_FLOATS, in C: the transposed operands packed, then
 * the small products' NN kernel (8 x 32 register blocks; each element one chain of fused
 * multiply-adds over k in order): score blocks are small (64 x 64 to 64 x 1024, k = d), where
 * a BLAS call's own packing and dispatch weigh (docs/performance.md); else by the plan's sgemm. */
static void plan_product(const int64_t *plan, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
                         int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc) {
    if (!plan[P_OWN] || (ta && m * k > PACK_FLOATS) || (tb && k * n > PACK_FLOATS)) {
        gl_sgemm(plan[P_SGEMM], plan[P_KIND], ta, tb, m, n, k, a, lda, b, ldb, c, ldc);
        return;
    }
    if (ta) {   /* a is stored [k, m] */
        transpose_into(a, k, m, lda, pack_a);
        a = pack_a, lda = k;
    }
    if (tb) {   /* b is stored [n, k] */
        transpose_into(b, n, k, ldb, pack_b);
        b = pack_b, ldb = n;
    }
    nn_product(a, b, c, m, k, lda, ldb, ldc, 0, n);
}

static float *plan_array(const int64_t *plan, int i) { return (float *)(intptr_t)plan[P_ARRAYS + i]; }

/* matrix m's query block b in the score buffer `e` */
static float *score_block(float *e, const int64_t *plan, int64_t b, int64_t m) {
    const int64_t *bound = plan + P_BOUNDS;
    int64_t before = 0;
    for (int64_t i = 0; i < b; i++) before += (bound[i + 1] - bound[i]) * bound[i + 1];
    return e + plan[P_M] * before + m * (bound[b + 1] - bound[b]) * bound[b + 1];
}

/* Forward, arrays q, k, v, o, E, l (t per matrix), qs (q * scale): per query block
 * E = exp(qs @ k^T - rowmax) under the causal mask (gl_causal_softmax_block), l = rowsum(E),
 * o = E @ v; then o /= l. */
void gl_causal_attention(const int64_t *plan, int64_t m0, int64_t m1, float scale) {
    const int64_t t = plan[P_T], d = plan[P_D], nb = plan[P_NB], *ld = plan + P_LD, *bound = plan + P_BOUNDS;
    const int64_t *offsets = (const int64_t *)(intptr_t)plan[P_OFFSETS];
    for (int64_t m = m0; m < m1; m++) {
        const int64_t *off = offsets + 4 * m;
        const float *qm = plan_array(plan, 0) + off[0], *km = plan_array(plan, 1) + off[1];
        const float *vm = plan_array(plan, 2) + off[2];
        float *om = plan_array(plan, 3) + m * t * d, *e = plan_array(plan, 4);
        float *lm = plan_array(plan, 5) + m * t, *qsm = plan_array(plan, 6) + m * t * d;
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < d; j++) qsm[i * d + j] = qm[i * ld[0] + j] * scale;
        for (int64_t b = 0; b < nb; b++) {
            int64_t r0 = bound[b], r1 = bound[b + 1];
            float *x = score_block(e, plan, b, m);
            plan_product(plan, 0, 1, r1 - r0, r1, d, qsm + r0 * d, d, km, ld[1], x, r1);
            gl_causal_softmax_block(x, lm + r0, 1, r1 - r0, r1, r0, 0);
            plan_product(plan, 0, 0, r1 - r0, d, r1, x, r1, vm, ld[2], om + r0 * d, d);
        }
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < d; j++) om[i * d + j] /= lm[i];
    }
}

/* Backward from the kept E and l, arrays q, k, v, o, g, E, l, out (dq, dk, dv: the node's
 * [3, ...] output), ds (a score buffer), gs, tmp (t x d per matrix), dd (t per matrix):
 *   dd = rowsum(g*o) / l,  gs = g / l,  per block: ds = (gs @ v^T - dd) * E (gl_softmax_ds_block),
 *   dq = ds @ k;  dk = the sum over blocks of ds^T @ q, dv of E^T @ gs (the last block writes,
 *   the others add, from the last to the first);  dq, dk times the scale. */
void gl_causal_attention_backward(const int64_t *plan, int64_t m0, int64_t m1, float scale) {
    const int64_t t = plan[P_T], d = plan[P_D], nm = plan[P_M], nb = plan[P_NB];
    const int64_t *ld = plan + P_LD, *bound = plan + P_BOUNDS;
    const int64_t *offsets = (const int64_t *)(intptr_t)plan[P_OFFSETS];
    for (int64_t m = m0; m < m1; m++) {
        const int64_t *off = offsets + 4 * m;
        const float *qm = plan_array(plan, 0) + off[0], *km = plan_array(plan, 1) + off[1];
        const float *vm = plan_array(plan, 2) + off[2], *om = plan_array(plan, 3) + m * t * d;
        const float *gm = plan_array(plan, 4) + off[3], *e = plan_array(plan, 5);
        const float *lm = plan_array(plan, 6) + m * t;
        float *out = plan_array(plan, 7), *ds = plan_array(plan, 8);
        float *dq = out + m * t * d, *dk = out + (nm + m) * t * d, *dv = out + (2 * nm + m) * t * d;
        float *gs = plan_array(plan, 9) + m * t * d, *tmp = plan_array(plan, 10) + m * t * d;
        float *dd = plan_array(plan, 11) + m * t;
        for (int64_t i = 0; i < t; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < d; j++) acc += gm[i * ld[3] + j] * om[i * d + j];
            dd[i] = acc / lm[i];
            for (int64_t j = 0; j < d; j++) gs[i * d + j] = gm[i * ld[3] + j] / lm[i];
        }
        for (int64_t b = nb - 1; b >= 0; b--) {
            int64_t r0 = bound[b], r1 = bound[b + 1], last = b == nb - 1;
            float *s = score_block(ds, plan, b, m);
            const float *x = score_block((float *)e, plan, b, m);
            plan_product(plan, 0, 1, r1 - r0, r1, d, gs + r0 * d, d, vm, ld[2], s, r1);
            gl_softmax_ds_block(s, x, dd + r0, 1, r1 - r0, r1, 0);
            plan_product(plan, 0, 0, r1 - r0, d, r1, s, r1, km, ld[1], dq + r0 * d, d);
            plan_product(plan, 1, 0, r1, d, r1 - r0, s, r1, qm + r0 * ld[0], ld[0], last ? dk : tmp, d);
            if (!last)
                for (int64_t i = 0; i < r1 * d; i++) dk[i] += tmp[i];
            plan_product(plan, 1, 0, r1, d, r1 - r0, x, r1, gs + r0 * d, d, last ? dv : tmp, d);
            if (!last)
                for (int64_t i = 0; i < r1 * d; i++) dv[i] += tmp[i];
        }
        for (int64_t i = 0; i < t * d; i++) {
            dq[i] *= scale;
            dk[i] *= scale;
        }
    }
}

/* ---- dropout (graphlm.random: counter-based splitmix64) ---------------------------------- */

#define GOLDEN 0x9E3779B97F4A7C15ull
#define MIX1 0xBF58476D1CE4E5B9ull
#define MIX2 0x94D049BB133111EBull

/* Elements [lo, hi): keep = mix64(base + (i+1)*GOLDEN) >= threshold (mix64's last xor-shift
 * left out: it does not change bits 33-63, the only ones the test reads; see
 * numpy_executor.keep_mask_drawer); mask[i] = keep and, when x is not NULL,
 * out[i] = (x[i] * keep) * scale. */
void gl_dropout_draw(uint8_t *mask, const float *x, float *out, int64_t lo, int64_t hi,
                     const uint64_t *base_word, uint64_t threshold, float scale) {
    const uint64_t base = *base_word;   /* (this run's stream start: a word the caller sets per run) */
    for (int64_t i = lo; i < hi; i++) {
        uint64_t z = base + (uint64_t)(i + 1) * GOLDEN;
        z = (z ^ (z >> 30)) * MIX1;
        z = (z ^ (z >> 27)) * MIX2;
        mask[i] = z >= threshold;
    }
    if (x)
        for (int64_t i = lo; i < hi; i++) out[i] = (x[i] * (float)mask[i]) * scale;
}

/* out = (x * mask) * scale over n elements. */
void gl_dropout_apply(const float *x, const uint8_t *mask, float *out, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * (float)mask[i]) * scale;
}

/* ---- AdamW (graphlm.optim), one parameter, in place -------------------------------------- */

/* The numpy kernel's arithmetic in its order, each product and sum rounded on its own:
 *   g = grad*coef; p *= decay (when wd); m = m*b1 + cb1*g; v = v*b2 + (cb2*g)*g;
 *   p -= (step*m) / (sqrt(v)/bc2 + eps) */
void gl_adamw(float *p, const float *grad, float *m, float *v, int64_t n, float coef, int wd,
              float decay, float b1, float cb1, float b2, float cb2, float bc2, float eps,
              float step) {
    for (int64_t i = 0; i < n; i++) {
        float g = grad[i] * coef;
        float pi = wd ? p[i] * decay : p[i];
        float mi = m[i] * b1 + cb1 * g;
        float vi = v[i] * b2 + (cb2 * g) * g;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - (step * mi) / (sqrtf(vi) / bc2 + eps);
    }
}

/* ---- small products: matmuls of few rows (executors/native/products.py) --------- */

/* out[e] = a[e] @ b[e] for the batch entries e in [e0, e1), over the columns [j0, j1) of each.
 * Entry e's operands start at a + offsets[3e], b + offsets[3e + 1], out + offsets[3e + 2]
 * (element offsets: any broadcast or stride of the batch axes); a is [m, k] with rows lda
 * apart, out [m, n] with rows ldo apart; b is [k, n] with rows ldb apart (gl_matmul_small) or
 * given as its transpose bt [n, k] with rows ldb apart (gl_matmul_small_nt: b = bt^T, as a key
 * cache read by a query). Elements are contiguous along each row.
 *
 * Every output element is computed by one fixed sequence of roundings that depends on k alone:
 *   NN: acc = 0; acc = MADD(a[i][p], b[p][j], acc) for p = 0, 1, ..., k-1;
 *   NT: 16 lane sums, lane l taking p = l, l+16, ... in order (as NN), then summed as a tree
 *       (lane l + lane l+8, then +4, +2, +1).
 * So a row's values are the same bits whatever m (decoding 8 rows or 1), the blocking below,
 * the column range or the thread computing it. The blocks only choose which accumulators live
 * in registers together: R rows x W columns, b's row read once for all R rows. */

#define NN_BLOCK(R, W)                                                                          \
    static inline void nn_block_##R##x##W(const float *a, const float *b, float *o, int64_t k,  \
                                          int64_t lda, int64_t ldb, int64_t ldo) {              \
        float acc[R][W];                                                                        \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < W; j++) acc[r][j] = 0.0f;                                       \
        for (int64_t p = 0; p < k; p++) {                                                       \
            const float *bp = b + p * ldb;                                                      \
            for (int j = 0; j < W; j += 16) __builtin_prefetch(bp + W + j); /* the next block */ \
            for (int r = 0; r < R; r++) {                                                       \
                float ar = a[r * lda + p];                                                      \
                for (int j = 0; j < W; j++) acc[r][j] = MADD(ar, bp[j], acc[r][j]);             \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < W; j++) o[r * ldo + j] = acc[r][j];                             \
    }
NN_BLOCK(8, 32)
NN_BLOCK(4, 64)
NN_BLOCK(2, 64)
NN_BLOCK(1, 256)
NN_BLOCK(1, 128)
NN_BLOCK(1, 64)
NN_BLOCK(1, 16)

/* `rows` rows x `w` columns (a block's ragged right edge), 16 columns at a time */
static void nn_edge(const float *a, const float *b, float *o, int64_t rows, int64_t k, int64_t w,
                    int64_t lda, int64_t ldb, int64_t ldo) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j0 = 0; j0 < w; j0 += 16) {
            int64_t cols = w - j0 < 16 ? w - j0 : 16;
            float acc[16];
            for (int64_t j = 0; j < cols; j++) acc[j] = 0.0f;
            for (int64_t p = 0; p < k; p++) {
                float ar = a[r * lda + p];
                const float *bp = b + p * ldb + j0;
                for (int64_t j = 0; j < cols; j++) acc[j] = MADD(ar, bp[j], acc[j]);
            }
            for (int64_t j = 0; j < cols; j++) o[r * ldo + j0 + j] = acc[j];
        }
}

/* rows [i, i + R) of one product, columns [j0, j1): W-wide blocks, then the edge */
#define NN_ROWS(R, W)                                                                           \
    for (; i + R <= m; i += R) {                                                                \
        int64_t j = j0;                                                                         \
        for (; j + W <= j1; j += W) nn_block_##R##x##W(a + i * lda, b + j, o + i * ldo + j, k, lda, ldb, ldo); \
        if (j < j1) nn_edge(a + i * lda, b + j, o + i * ldo + j, R, k, j1 - j, lda, ldb, ldo);  \
    }

static void nn_product(const float *a, const float *b, float *o, int64_t m, int64_t k,
                       int64_t lda, int64_t ldb, int64_t ldo, int64_t j0, int64_t j1) {
    int64_t i = 0;
    NN_ROWS(8, 32)
    NN_ROWS(4, 64)
    NN_ROWS(2, 64)
    if (i < m) {   /* the last row: blocks as wide as fit (a block's k-long chains are its latency) */
        int64_t j = j0;
        const float *ai = a + i * lda;
        float *oi = o + i * ldo;
        for (; j + 256 <= j1; j += 256) nn_block_1x256(ai, b + j, oi + j, k, lda, ldb, ldo);
        if (j + 128 <= j1) { nn_block_1x128(ai, b + j, oi + j, k, lda, ldb, ldo); j += 128; }
        if (j + 64 <= j1) { nn_block_1x64(ai, b + j, oi + j, k, lda, ldb, ldo); j += 64; }
        for (; j + 16 <= j1; j += 16) nn_block_1x16(ai, b + j, oi + j, k, lda, ldb, ldo);
        if (j < j1) nn_edge(ai, b + j, oi + j, 1, k, j1 - j, lda, ldb, ldo);
    }
}

/* one row x 32 columns of Q products at once (entry q's a, b, out at a[q], b[q], o[q]): 2Q
 * independent accumulator chains where one product has two (a query's read of the value cache) */
static inline __attribute__((always_inline)) void nn_entries_1x32(const float *const a[4],
        const float *const b[4], float *const o[4], int64_t k, int64_t ldb, const int Q) {
    float acc[4][32];
    for (int q = 0; q < Q; q++)
        for (int j = 0; j < 32; j++) acc[q][j] = 0.0f;
    for (int64_t p = 0; p < k; p++)
        for (int q = 0; q < Q; q++) {
            float ap = a[q][p];
            const float *bp = b[q] + p * ldb;
            for (int j = 0; j < 32; j++) acc[q][j] = MADD(ap, bp[j], acc[q][j]);
        }
    for (int q = 0; q < Q; q++)
        for (int j = 0; j < 32; j++) o[q][j] = acc[q][j];
}

void gl_matmul_small(const float *a, const float *b, float *o, const int64_t *offsets, int64_t e0,
                     int64_t e1, int64_t m, int64_t k, int64_t lda, int64_t ldb, int64_t ldo,
                     int64_t j0, int64_t j1) {
    int64_t e = e0;
    if (m == 1 && j1 - j0 < 128)   /* one row of few columns: four (or two) entries at a time */
        for (int Q = 4; Q >= 2; Q /= 2)
            for (; e + Q <= e1; e += Q) {
                const int64_t *f = offsets + 3 * e;
                int64_t j = j0;
                for (; j + 32 <= j1; j += 32) {
                    const float *aq[4], *bq[4];
                    float *oq[4];
                    for (int q = 0; q < Q; q++) {
                        aq[q] = a + f[3 * q];
                        bq[q] = b + f[3 * q + 1] + j;
                        oq[q] = o + f[3 * q + 2] + j;
                    }
                    if (Q == 4) nn_entries_1x32(aq, bq, oq, k, ldb, 4);
                    else nn_entries_1x32(aq, bq, oq, k, ldb, 2);
                }
                for (int q = 0; q < Q && j < j1; q++)
                    nn_product(a + f[3 * q], b + f[3 * q + 1], o + f[3 * q + 2], 1, k, lda, ldb, ldo, j, j1);
            }
    for (; e < e1; e++)
        nn_product(a + offsets[3 * e], b + offsets[3 * e + 1], o + offsets[3 * e + 2], m, k, lda,
                   ldb, ldo, j0, j1);
}

/* NT: one dot product's 16 lane sums into acc (lane l: p = l, l+16, ... < k, in order) */
static inline void nt_lanes(const float *x, const float *y, int64_t k, float acc[16]) {
    int64_t p = 0;
    for (; p + 16 <= k; p += 16)
        for (int l = 0; l < 16; l++) acc[l] = MADD(x[p + l], y[p + l], acc[l]);
    for (int l = 0; p + l < k; l++) acc[l] = MADD(x[p + l], y[p + l], acc[l]);
}

static inline float lanes_tree(float acc[16]) {
    for (int h = 8; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) acc[l] += acc[l + h];
    return acc[0];
}

/* NT, rows [i0, i1) x columns [j0, j1) of one product, one dot product at a time */
static void nt_scalar(const float *a, const float *bt, float *o, int64_t i0, int64_t i1,
                      int64_t j0, int64_t j1, int64_t k, int64_t lda, int64_t ldb, int64_t ldo) {
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) {
            float acc[16] = {0};
            nt_lanes(a + i * lda, bt + j * ldb, k, acc);
            o[i * ldo + j] = lanes_tree(acc);
        }
}

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>

/* bt is prefetched this many elements (16 KB) ahead of the block reading it, in whole rows:
 * weights come from L3 (-35 % at batch 8), and a prefetch further ahead than L1 holds evicts
 * the rows of a that every block reads (k = 768: 16 rows ahead was 48 KB, 2x slower) */
#define NT_AHEAD_ELEMENTS 2048

/* 16 vectors of lane sums -> one vector: lane L holds the lanes_tree sum of v[4*(L%4) + L/4]
 * (each level adds lane l and lane l+h of every source, as lanes_tree does, h = 8, 4, 2, 1) */
static inline __m512 nt_reduce16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)   /* h = 8: [v2i(l) + v2i(l+8) | v2i+1(l) + v2i+1(l+8)] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)   /* h = 4: one source's four sums per 128-bit chunk */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)   /* h = 2 */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),   /* h = 1 */
                         _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

/* v's lanes from `first` on, moved down to lane 0 */
static inline __m512 lanes_from(int first, __m512 v) {
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(first)), v);
}

/* NT block of R rows x J columns (R*J = 16): out[r][c] for its 16 dot products */
static inline __attribute__((always_inline)) void nt_block(const float *a, const float *bt,
        float *o, int64_t k, int64_t lda, int64_t ldb, int64_t ldo, const int R, const int J) {
    __m512 acc[16], x[8], y[16];
    for (int s = 0; s < 16; s++) acc[s] = _mm512_setzero_ps();
    const int64_t ahead = (NT_AHEAD_ELEMENTS / ldb > J ? NT_AHEAD_ELEMENTS / ldb : J) * ldb;
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) {
        for (int r = 0; r < R; r++) x[r] = _mm512_loadu_ps(a + r * lda + p);
        for (int c = 0; c < J; c++) {
            y[c] = _mm512_loadu_ps(bt + c * ldb + p);
            __asm__("" : "+v"(y[c]));   /* in a register: the compiler would reload it per row */
            _mm_prefetch((const char *)(bt + c * ldb + ahead + p), _MM_HINT_T0);
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < J; c++) {   /* lane sum s: the reduction's source of lane r*J + c */
                int L = r * J + c, s = 4 * (L % 4) + L / 4;
                acc[s] = _mm512_fmadd_ps(x[r], y[c], acc[s]);
            }
    }
    if (p < k) {   /* the last k % 16 terms, in lanes 0.. (the others left as they are) */
        __mmask16 mask = (__mmask16)((1u << (k - p)) - 1u);
        for (int r = 0; r < R; r++) x[r] = _mm512_maskz_loadu_ps(mask, a + r * lda + p);
        for (int c = 0; c < J; c++) y[c] = _mm512_maskz_loadu_ps(mask, bt + c * ldb + p);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < J; c++) {
                int L = r * J + c, s = 4 * (L % 4) + L / 4;
                acc[s] = _mm512_mask3_fmadd_ps(x[r], y[c], acc[s], mask);
            }
    }
    __m512 sums = nt_reduce16(acc);   /* lane r*J + c: out[r][c] */
    for (int r = 0; r < R; r++) {
        __m512 row = r ? lanes_from(r * J, sums) : sums;
        _mm512_mask_storeu_ps(o + r * ldo, (__mmask16)((1u << J) - 1u), row);
    }
}

#define NT_ROWS(R, J)                                                                           \
    for (; i + R <= m; i += R) {                                                                \
        int64_t j = j0;                                                                         \
        for (; j + J <= j1; j += J) nt_block(ae + i * lda, be + j * ldb, oe + i * ldo + j, k, lda, ldb, ldo, R, J); \
        nt_scalar(ae, be, oe, i, i + R, j, j1, k, lda, ldb, ldo);                               \
    }

/* the columns [j0, j1) of one product: per 4 columns, all row blocks of 4 (b's rows stay in L1) */
static void nt_product(const float *ae, const float *be, float *oe, int64_t m, int64_t k,
                       int64_t lda, int64_t ldb, int64_t ldo, int64_t j0, int64_t j1) {
    if (m >= 4) {
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) {
            int64_t i = 0;
            for (; i + 4 <= m; i += 4) nt_block(ae + i * lda, be + j * ldb, oe + i * ldo + j, k, lda, ldb, ldo, 4, 4);
            for (; i < m; i++) nt_scalar(ae, be, oe, i, i + 1, j, j + 4, k, lda, ldb, ldo);
        }
        nt_scalar(ae, be, oe, 0, m, j, j1, k, lda, ldb, ldo);
        return;
    }
    int64_t i = 0;
    NT_ROWS(2, 8)
    NT_ROWS(1, 4)   /* one row: 4 rows of bt at a time, 4 streams from memory (16 was 7 % slower at batch 1) */
}
#else
static void nt_product(const float *ae, const float *be, float *oe, int64_t m, int64_t k,
                       int64_t lda, int64_t ldb, int64_t ldo, int64_t j0, int64_t j1) {
    nt_scalar(ae, be, oe, 0, m, j0, j1, k, lda, ldb, ldo);
}
#endif

void gl_matmul_small_nt(const float *a, const float *bt, float *o, const int64_t *offsets,
                        int64_t e0, int64_t e1, int64_t m, int64_t k, int64_t lda, int64_t ldb,
                        int64_t ldo, int64_t j0, int64_t j1) {
    for (int64_t e = e0; e < e1; e++)
        nt_product(a + offsets[3 * e], bt + offsets[3 * e + 1], o + offsets[3 * e + 2], m, k, lda,
                   ldb, ldo, j0, j1);
}

/* ---- cached attention: one decode step against the KV cache (graphlm.ops.cached_attention) ---- */

/* Two steps of a row, each in one fixed order (the AVX-512 code and the plain C below round alike):
 *   scores:  s_c = q . key_c for up to 16 keys, each dot as the small products' NT kernel
 *            computes it (16 lane sums over d, then their tree: nt_lanes, lanes_tree);
 *   values:  o = (((a_0 + a_1) + (a_2 + a_3)) + e_p * v) / l per column, a_u the multiply-add
 *            chain of e_j * cv[j] over the cached slots j = u mod 4, j < p, in order (four chains
 *            side by side). */
#if defined(__AVX512F__) && defined(__FMA__)
/* s[0..n) = q . key[c] (n <= 16; the unused lanes read q and are not stored) */
static inline void attention_dots(const float *q, const float *const key[16], int n, int64_t d, float *s) {
    const float *row[16];
    for (int c = 0; c < 16; c++) row[c] = c < n ? key[c] : q;
    __m512 acc[16];
    for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= d; p += 16) {
        __m512 x = _mm512_loadu_ps(q + p);
        for (int c = 0; c < 16; c++)   /* key c's sums in the reduction's source of lane c */
            acc[4 * (c % 4) + c / 4] = _mm512_fmadd_ps(x, _mm512_loadu_ps(row[c] + p), acc[4 * (c % 4) + c / 4]);
    }
    if (p < d) {
        __mmask16 mask = (__mmask16)((1u << (d - p)) - 1u);
        __m512 x = _mm512_maskz_loadu_ps(mask, q + p);
        for (int c = 0; c < 16; c++)
            acc[4 * (c % 4) + c / 4] = _mm512_mask3_fmadd_ps(x, _mm512_maskz_loadu_ps(mask, row[c] + p),
                                                             acc[4 * (c % 4) + c / 4], mask);
    }
    _mm512_mask_storeu_ps(s, (__mmask16)((1u << n) - 1u), nt_reduce16(acc));
}

/* columns [0, w) of the row's output, w <= 16 (see above) */
static inline void attention_values(const float *e, const float *cv, const float *v, float *o,
                                    int64_t p, int64_t d, float l, int64_t w) {
    __mmask16 mask = (__mmask16)((1u << w) - 1u);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;   /* (named: kept in registers) */
#define VALUE_TERM(acc, j) acc = _mm512_fmadd_ps(_mm512_set1_ps(e[j]), _mm512_maskz_loadu_ps(mask, cv + (j) * d), acc)
    int64_t j = 0;
    for (; j + 4 <= p; j += 4) {
        VALUE_TERM(a0, j); VALUE_TERM(a1, j + 1); VALUE_TERM(a2, j + 2); VALUE_TERM(a3, j + 3);
    }
    if (j < p) VALUE_TERM(a0, j);
    if (j + 1 < p) VALUE_TERM(a1, j + 1);
    if (j + 2 < p) VALUE_TERM(a2, j + 2);
#undef VALUE_TERM
    __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    sum = _mm512_fmadd_ps(_mm512_set1_ps(e[p]), _mm512_maskz_loadu_ps(mask, v), sum);
    _mm512_mask_storeu_ps(o, mask, _mm512_div_ps(sum, _mm512_set1_ps(l)));
}
#else
static inline void attention_dots(const float *q, const float *const key[16], int n, int64_t d, float *s) {
    for (int c = 0; c < n; c++) {
        float acc[16] = {0};
        nt_lanes(q, key[c], d, acc);
        s[c] = lanes_tree(acc);
    }
}

static inline void attention_values(const float *e, const float *cv, const float *v, float *o,
                                    int64_t p, int64_t d, float l, int64_t w) {
    for (int64_t i = 0; i < w; i++) {
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t j = 0; j < p; j++) a[j % 4] = MADD(e[j], cv[j * d + i], a[j % 4]);
        o[i] = MADD(e[p], v[i], (a[0] + a[1]) + (a[2] + a[3])) / l;
    }
}
#endif

/* Rows [r0, r1) of a decode step's attention (a row: one batch row's head). Row r's query, new
 * key, new value and output are d floats at q + r*ldq, k + r*ldk, v + r*ldv, out + r*ldo; its
 * caches are t x d floats at ck + r*ldc, cv + r*ldc. With p = *position (0 <= p < t, checked by
 * the caller), only the cached slots j < p are read:
 *   s_j = (q . ck[j]) * scale (j < p),  s_p = (q . k) * scale   (attention_dots),
 *   e_j = exp_f32(s_j - max_j s_j),  l = row_sum(e_0..e_p),
 *   out = (e_0 cv[0] + ... + e_{p-1} cv[p-1] + e_p v) / l   (attention_values).
 * `scores` holds t + 1 floats per row (row r at scores + r*(t+1)). Each row is one fixed sequence
 * of roundings that depends on p and d alone (a slot's score on d alone), so its bits do not
 * depend on the rows around it or the thread. */
void gl_cached_attention(const float *q, const float *k, const float *v, const float *ck,
                         const float *cv, float *out, float *scores, const int64_t *position,
                         int64_t r0, int64_t r1, int64_t t, int64_t d, int64_t ldq, int64_t ldk,
                         int64_t ldv, int64_t ldo, int64_t ldc, float scale) {
    const int64_t p = *position;
    for (int64_t r = r0; r < r1; r++) {
        const float *qr = q + r * ldq, *kc = ck + r * ldc, *vc = cv + r * ldc;
        float *s = scores + r * (t + 1), *o = out + r * ldo;
        for (int64_t j0 = 0; j0 <= p; j0 += 16) {   /* the slots j < p, then the new key */
            const float *key[16];
            int n = p + 1 - j0 < 16 ? (int)(p + 1 - j0) : 16;
            for (int c = 0; c < n; c++) key[c] = j0 + c < p ? kc + (j0 + c) * d : k + r * ldk;
            attention_dots(qr, key, n, d, s + j0);
        }
        for (int64_t j = 0; j <= p; j++) s[j] = s[j] * scale;
        const float m = row_max(s, p + 1);
        for (int64_t j = 0; j <= p; j++) s[j] = exp_f32(s[j] - m);
        const float l = row_sum(s, p + 1);
        for (int64_t i = 0; i < d; i += 16)
            attention_values(s, vc + i, v + r * ldv + i, o + i, p, d, l, d - i < 16 ? d - i : 16);
    }
}
