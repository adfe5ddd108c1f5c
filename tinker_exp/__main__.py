from tinker_exp.main import main

main()
