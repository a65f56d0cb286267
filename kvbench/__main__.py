from kvbench.cli import main

raise SystemExit(main())
