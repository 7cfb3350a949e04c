/* graphlm's native kernels, the row and elementwise ones: elementwise ops, the memory-bound add,
 * multiply, outer sums and strided copies, layer norm, cross entropy, the embedding gradient,
 * dropout and AdamW (executors/native/kernels.py
 * binds them; kernels.h says what every C file here shares). */
#include "kernels.h"

/* ---- elementwise ------------------------------------------------------------------------ */

void gl_exp(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = exp_f32(x[i]);
}

/* tanh GELU (graphlm.ops' GELU note): s = 1 / (exp((x*x*a + b)*x) + 1), y = x*s, and its
 * derivative d = (1 - s)*s*x*(x*x*da + db) + s, the input gradient g*d. One expression each, for
 * every GELU kernel below. */
static inline float gelu_sigmoid(float x, float a, float b) {
    return 1.0f / (exp_f32((x * x * a + b) * x) + 1.0f);
}
static inline float gelu_slope(float x, float s, float da, float db) {
    return (1.0f - s) * s * x * (x * x * da + db) + s;
}

/* y = x*s; s kept when `keep` is not NULL, for the backward. */
void gl_gelu_tanh(const float *x, float *y, float *keep, int64_t n, float a, float b) {
    if (keep) {
        for (int64_t i = 0; i < n; i++) {
            float s = gelu_sigmoid(x[i], a, b);
            keep[i] = s;
            y[i] = x[i] * s;
        }
    } else {
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * gelu_sigmoid(x[i], a, b);   /* x*s, not x/(e + 1) */
    }
}

/* The tanh GELU's sigmoid alone, as gl_gelu_tanh keeps it. */
void gl_gelu_tanh_sigmoid(const float *x, float *s, int64_t n, float a, float b) {
    for (int64_t i = 0; i < n; i++) s[i] = gelu_sigmoid(x[i], a, b);
}

/* The input gradient out = g*d, from the forward's kept s, or with s recomputed (constants a, b)
 * when `kept` is NULL. */
void gl_gelu_tanh_backward(const float *x, const float *g, const float *kept, float *out, int64_t n,
                           float a, float b, float da, float db) {
    if (kept) {
        for (int64_t i = 0; i < n; i++) out[i] = g[i] * gelu_slope(x[i], kept[i], da, db);
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = g[i] * gelu_slope(x[i], gelu_sigmoid(x[i], a, b), da, db);
    }
}

/* bias_gelu: rows [r0, r1) of y = gelu(m + bias), m and y [rows, cols] contiguous, bias [cols]
 * (x = m + bias one rounding, as the add; y never m: the kernel table gives the op no in-place). */
void gl_bias_gelu_tanh(const float *restrict m, const float *restrict bias, float *restrict y, int64_t cols,
                       int64_t r0, int64_t r1, float a, float b) {
    for (int64_t r = r0; r < r1; r++) {
        const float *mr = m + r * cols;
        float *yr = y + r * cols;
        for (int64_t j = 0; j < cols; j++) {
            float x = mr[j] + bias[j];
            yr[j] = x * gelu_sigmoid(x, a, b);
        }
    }
}

/* bias_gelu_backward: rows [r0, r1) of out = g * d(m + bias), m, g and out [rows, cols]
 * contiguous, bias [cols] (m + bias one rounding, as the add). */
void gl_bias_gelu_tanh_backward(const float *restrict m, const float *restrict bias, const float *restrict g,
                                float *restrict out, int64_t cols, int64_t r0, int64_t r1, float a, float b,
                                float da, float db) {
    for (int64_t r = r0; r < r1; r++) {
        const float *mr = m + r * cols, *gr = g + r * cols;
        float *outr = out + r * cols;
        for (int64_t j = 0; j < cols; j++) {
            float x = mr[j] + bias[j];
            outr[j] = gr[j] * gelu_slope(x, gelu_sigmoid(x, a, b), da, db);
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

/* out[g][j] = ((0 + x[g][0][j]) + x[g][1][j]) + ... + x[g][R-1][j], x [G, R, C] contiguous: NumPy's
 * add.reduce over the middle axis (it starts from its identity 0, so -0 sums to +0, and adds the
 * rows in order), for the columns u in [u0, u1) of the groups laid end to end (column j of group
 * g is u = g*C + j): a cut of that range gives a thread whole groups and at most two parts, and
 * rows read whole cost less than the same bytes in half rows. */
void gl_sum_rows(const float *x, float *out, int64_t groups, int64_t rows, int64_t cols, int64_t u0, int64_t u1) {
    for (int64_t g = u0 / cols; g < groups && g * cols < u1; g++) {
        const float *xg = x + g * rows * cols;
        float *og = out + g * cols;
        const int64_t j0 = u0 > g * cols ? u0 - g * cols : 0, j1 = u1 < (g + 1) * cols ? u1 - g * cols : cols;
        for (int64_t b0 = j0; b0 < j1; b0 += SUM_BLOCK) {
            int64_t b1 = j1 - b0 < SUM_BLOCK ? j1 : b0 + SUM_BLOCK;
            float acc[SUM_BLOCK];
            for (int64_t j = 0; j < b1 - b0; j++) acc[j] = 0.0f;
            for (int64_t i = 0; i < rows; i++) {
                const float *xr = xg + i * cols + b0;
                for (int64_t j = 0; j < b1 - b0; j++) acc[j] += xr[j];
            }
            for (int64_t j = 0; j < b1 - b0; j++) og[b0 + j] = acc[j];
        }
    }
}

/* columns [j0, j1) of an affine map's weight and bias gradients over the rows of g and x [R, C]
 * (contiguous): out[j] = sum_i g[i][j] * x[i][j] and out[C + j] = sum_i g[i][j], each rounded as
 * gl_sum_rows sums (from 0, the rows in order; each product rounded first), in one pass. With d
 * (one value per row, not NULL) x[i][j] / d[i] takes the place of x[i][j] (rounded first, as the
 * layer norm's xhat = xc / sv is). */
void gl_affine_grads(const float *restrict g, const float *restrict x, const float *restrict d, float *restrict out,
                     int64_t rows, int64_t cols, int64_t j0, int64_t j1) {
    for (int64_t b0 = j0; b0 < j1; b0 += SUM_BLOCK) {
        int64_t b1 = j1 - b0 < SUM_BLOCK ? j1 : b0 + SUM_BLOCK;
        float ow[SUM_BLOCK], ob[SUM_BLOCK];
        for (int64_t j = 0; j < b1 - b0; j++) ow[j] = ob[j] = 0.0f;
        for (int64_t i = 0; i < rows; i++) {
            const float *gr = g + i * cols + b0, *xr = x + i * cols + b0;
            if (d) {
                const float di = d[i];
                for (int64_t j = 0; j < b1 - b0; j++) {
                    ow[j] += gr[j] * (xr[j] / di);
                    ob[j] += gr[j];
                }
            } else {
                for (int64_t j = 0; j < b1 - b0; j++) {
                    ow[j] += gr[j] * xr[j];
                    ob[j] += gr[j];
                }
            }
        }
        for (int64_t j = 0; j < b1 - b0; j++) {
            out[b0 + j] = ow[j];
            out[cols + b0 + j] = ob[j];
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

/* ---- gathers and writes of rows: an embedding's lookup, a KV cache's write ---------------- */

/* out[i] = table[ids[i]] for the ids [i0, i1), rows of `dim` floats; an id outside [0, rows) is
 * clamped (np.take's mode="clip": the caller has checked the ids, executors/native/kernels.py) */
void gl_embedding_rows(const float *table, const int64_t *ids, float *out, int64_t i0, int64_t i1,
                       int64_t rows, int64_t dim) {
    for (int64_t i = i0; i < i1; i++) {
        int64_t id = ids[i] < 0 ? 0 : ids[i] >= rows ? rows - 1 : ids[i];
        memcpy(out + i * dim, table + id * dim, (size_t)dim * sizeof(float));
    }
}

/* A KV cache's write at the position *pos (checked by the caller): value [n0, n1, n2] at element
 * strides (vs0, vs1, 1) into the cache's [n0, n1, n2] at (cs0, cs1, 1) from cache + *pos * step;
 * the op's token out = 0. */
void gl_cache_write(const float *value, float *cache, const int64_t *pos, float *token, int64_t step,
                    int64_t n0, int64_t n1, int64_t n2, int64_t vs0, int64_t vs1, int64_t cs0, int64_t cs1) {
    float *base = cache + *pos * step;
    for (int64_t i = 0; i < n0; i++)
        for (int64_t j = 0; j < n1; j++)
            memcpy(base + i * cs0 + j * cs1, value + i * vs0 + j * vs1, (size_t)n2 * sizeof(float));
    *token = 0.0f;
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
 * both are recomputed (eps used only then). When `res` is not NULL (with sv) the residual
 * stream's gradient is added: out = res + that (the add's rounding; out may be g or res). */
void gl_layer_norm_backward(const float *xc, const float *sv, const float *g, const float *w,
                            const float *res, float *out, int64_t rows, int64_t cols, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *cr = xc + r * cols, *gr = g + r * cols, *rs = res ? res + r * cols : NULL;
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
            float d = rr * (gh - m1 - (cr[i] * rr) * m2);
            o[i] = rs ? rs[i] + d : d;
        }
    }
}

/* ---- cross entropy (rows of `cols` logits) and the embedding gradient ------------------ */

/* The sum of exp(x - mx) over a row, in row_sum's order (LANES partial sums, the tail, then the
 * lanes), without storing the exps. */
static inline float row_exp_sum(const float *x, float mx, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += exp_f32(x[i + j] - mx);
    float s = 0.0f;
    for (; i < n; i++) s += exp_f32(x[i] - mx);
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* Each row's loss, loss[r] = (log(sum(exp(x - m))) + m) - x[target[r]], m the row max (the mean
 * over rows is the caller's, in one fixed order whatever the rows' split). */
void gl_cross_entropy_rows(const float *x, const int64_t *target, float *loss, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float mx = row_max(xr, cols);
        loss[r] = (logf(row_exp_sum(xr, mx, cols)) + mx) - xr[target[r]];
    }
}

/* Its gradient, out = (softmax(x) - onehot(target)) * (g / count) per row: e/s rounded, the
 * target's minus 1, then times the scale, as the decomposition rounds. out may be x. */
void gl_cross_entropy_backward_rows(const float *x, const int64_t *target, const float *g, float *out,
                                    int64_t rows, int64_t cols, int64_t count) {
    const float scale = *g / (float)count;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *o = out + r * cols;
        float mx = row_max(xr, cols);
        for (int64_t i = 0; i < cols; i++) o[i] = exp_f32(xr[i] - mx);
        float s = row_sum(o, cols), picked = o[target[r]] / s - 1.0f;
        for (int64_t i = 0; i < cols; i++) o[i] = (o[i] / s) * scale;
        o[target[r]] = picked * scale;
    }
}

/* Columns [c0, c1) of the embedding's gradient out [rows, dim]: zero, then out[ids[i]] += g[i]
 * for i = 0 .. n-1 in order (np.add.at's order from zero: the numpy kernel's bits). */
void gl_embedding_backward(const int64_t *ids, const float *g, float *out, int64_t n, int64_t rows, int64_t dim,
                           int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = c0; c < c1; c++) out[r * dim + c] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float *gi = g + i * dim;
        float *o = out + ids[i] * dim;
        for (int64_t c = c0; c < c1; c++) o[c] += gi[c];
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

/* rows [r0, r1) of out = r + ((m + b) * keep) * scale, rows of `cols`, b one row for all (a
 * residual add of a product's output with its bias, dropped out: the three ops' roundings) */
void gl_bias_dropout_add(const float *r, const float *m, const float *b, const uint8_t *keep, float *out,
                         int64_t cols, int64_t r0, int64_t r1, float scale) {
    for (int64_t i = r0; i < r1; i++) {
        const float *ri = r + i * cols, *mi = m + i * cols;
        const uint8_t *ki = keep + i * cols;
        float *oi = out + i * cols;
        for (int64_t j = 0; j < cols; j++) oi[j] = ri[j] + ((mi[j] + b[j]) * (float)ki[j]) * scale;
    }
}

/* ---- AdamW (graphlm.optim), in place: one parameter, or a run of a table's --------------- */

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

/* gl_adamw over the parameters [lo, hi) of `params`, ADAMW_WORDS words each: the addresses of
 * p, grad, m and v, the size, whether it decays, and its row of `consts`. consts[0..4] are b1,
 * 1 - b1, b2, 1 - b2 and eps; row r (at 8 + 4r) this run's coef, decay, step and bc2, which the
 * caller writes before each run (the learning rate follows a schedule). */
#define ADAMW_WORDS 7
void gl_adamw_params(const int64_t *params, const float *consts, int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; k++) {
        const int64_t *w = params + ADAMW_WORDS * k;
        const float *c = consts + 8 + 4 * w[6];
        gl_adamw((float *)(uintptr_t)w[0], (const float *)(uintptr_t)w[1], (float *)(uintptr_t)w[2],
                 (float *)(uintptr_t)w[3], w[4], c[0], (int)w[5], c[1], consts[0], consts[1], consts[2],
                 consts[3], c[3], consts[4], c[2]);
    }
}

/* ---- the global norm's dots (graphlm.optim's gradient clipping) -------------------------- */

/* dots[i] = x_i . x_i for the gradients [lo, hi) (addresses and sizes in `addrs`, `sizes`), each
 * by NumPy's OpenBLAS cblas_sdot at `sdot` (64-bit integers where `wide`): the function np.dot
 * calls, so the numpy kernel's dots bit for bit. The caller adds them in order. */
typedef float (*sdot64_fn)(int64_t, const float *, int64_t, const float *, int64_t);
typedef float (*sdot32_fn)(int32_t, const float *, int32_t, const float *, int32_t);
void gl_self_dots(const int64_t *addrs, const int64_t *sizes, float *dots, int64_t lo, int64_t hi,
                  uint64_t sdot, int64_t wide) {
    for (int64_t i = lo; i < hi; i++) {
        const float *x = (const float *)(uintptr_t)addrs[i];
        dots[i] = wide ? ((sdot64_fn)(uintptr_t)sdot)(sizes[i], x, 1, x, 1)
                       : ((sdot32_fn)(uintptr_t)sdot)((int32_t)sizes[i], x, 1, x, 1);
    }
}
