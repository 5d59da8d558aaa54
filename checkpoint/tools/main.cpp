// zeroshard-ckpt (tools/zeroshard_ckpt.cpp, in the checkpoint library).
int zeroshard_ckpt_main(int argc, char** argv);

int main(int argc, char** argv) { return zeroshard_ckpt_main(argc, argv); }
