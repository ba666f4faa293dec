from k3_tail.cli import main

raise SystemExit(main())
