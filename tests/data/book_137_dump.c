/* The chapter's 137_Gpt.c (book_137_gpt.c, unchanged) with its main renamed, and a main of our
 * own that draws the same weights in the same order from the same C library rand() and runs the
 * chapter's own block_fwd / rmsnorm / dot on the same input. It prints every weight and the
 * logits before the softmax, at full float precision, one array per line:
 *
 *     NAME v0 v1 v2 ...
 *
 * tests/test_book_gpt.py loads the weights into graphlm's book-gpt and compares the logits.
 * The order of the draws follows the chapter's main line for line (embed, pos_embed, blocks).
 */
#define main book_137_main
#include "book_137_gpt.c"
#undef main

static void print_array(const char *name, const float *p, int n)
{
    int i;
    printf("%s", name);
    for (i = 0; i < n; i++) printf(" %.9g", p[i]);
    printf("\n");
}

int main(void)
{
    float embed[VOCAB][DM];
    float pos_embed[SL][DM];
    Block blocks[N_BLOCKS];
    int tokens[] = { 3, 1, 4, 1, 5, 2 };
    int seq_len = 6;
    float X[SL][DM];
    int i, j, b;
    char name[64];

    srand(42);
    for (i = 0; i < VOCAB; i++)
        for (j = 0; j < DM; j++)
            embed[i][j] = (randf()*2-1) * 0.3f;
    for (i = 0; i < SL; i++)
        for (j = 0; j < DM; j++)
            pos_embed[i][j] = (randf()*2-1) * 0.1f;
    for (b = 0; b < N_BLOCKS; b++) {
        float *w = (float*)&blocks[b];
        int n = (int)(sizeof(Block)/sizeof(float));
        for (i = 0; i < n; i++)
            w[i] = (randf()*2-1) * 0.1f;
    }

    print_array("embed", &embed[0][0], VOCAB * DM);
    print_array("pos_embed", &pos_embed[0][0], SL * DM);
    for (b = 0; b < N_BLOCKS; b++) {
        sprintf(name, "block%d.WQ", b); print_array(name, &blocks[b].WQ[0][0][0], NH * DH * DM);
        sprintf(name, "block%d.WK", b); print_array(name, &blocks[b].WK[0][0][0], NH * DH * DM);
        sprintf(name, "block%d.WV", b); print_array(name, &blocks[b].WV[0][0][0], NH * DH * DM);
        sprintf(name, "block%d.WO", b); print_array(name, &blocks[b].WO[0][0], DM * DM);
        sprintf(name, "block%d.W1", b); print_array(name, &blocks[b].W1[0][0], DF * DM);
        sprintf(name, "block%d.W2", b); print_array(name, &blocks[b].W2[0][0], DM * DF);
    }

    for (i = 0; i < seq_len; i++)
        for (j = 0; j < DM; j++)
            X[i][j] = embed[tokens[i]][j] + pos_embed[i][j];
    for (b = 0; b < N_BLOCKS; b++)
        block_fwd(&blocks[b], X, seq_len);
    for (i = 0; i < seq_len; i++)
        rmsnorm(X[i], X[i], DM);
    for (i = 0; i < seq_len; i++) {
        float logits[VOCAB];
        for (j = 0; j < VOCAB; j++)
            logits[j] = dot(X[i], embed[j], DM);
        sprintf(name, "logits%d", i);
        print_array(name, logits, VOCAB);
    }
    return 0;
}
