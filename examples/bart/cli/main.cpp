// bart_pretrain (pretrain.cpp, in the zs_bart library).
int bart_pretrain_main(int argc, char** argv);

int main(int argc, char** argv) { return bart_pretrain_main(argc, argv); }
