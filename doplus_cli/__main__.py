from doplus_cli.cli import main

if __name__ == "__main__":
    main()
