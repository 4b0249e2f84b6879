from routetool.cli import main

main()
