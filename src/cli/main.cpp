#include <cstdio>
int main() { std::puts("kestrel"); return 0; }
