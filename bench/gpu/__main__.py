from bench.gpu.run import main

main()
