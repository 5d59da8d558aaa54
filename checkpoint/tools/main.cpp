// zeroshard-ckpt (tools/zeroshard_ckpt.cpp, in the checkpoint library).
#include "tools/zeroshard_ckpt.h"

int main(int argc, char** argv) { return zeroshard_ckpt_main(argc, argv); }
