from memcalc.cli import main

main()
