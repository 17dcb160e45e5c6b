/* engram_path_end.h: the end of a template's copy (engram_path.h): its shared settings and
 * ES_PATH undefined, so the next copy sets its own. */
#undef ES_PATH
#undef ES_SFX
#undef ES_TGT
#undef ES_VW
#undef ES_F16C
#undef ES_NEON
#undef ES_PATH_CAT2
#undef ES_PATH_CAT
#undef ES_SF
#undef ES_KI
